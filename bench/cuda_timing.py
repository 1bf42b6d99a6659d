"""GPU timings for the kernel benchmarks: CUDA events around CUDA-graph replays (the kernels' own time, without
Python's launch cost) and around eager back-to-back calls (what a caller that launches from Python sees).

Each timing cycles through several calls, one per input set, so that weights larger in all than the L2 cache are
read from device memory as a decode step reads them (`rotation` picks how many sets).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

L2_BYTES = 64 << 20                     # at least an H100's 50 MB or an H200's 60 MB of L2


def rotation(bytes_per_set: int, most: int = 64) -> int:
    """How many input sets of bytes_per_set make a cycle at least three times the L2 cache."""
    return max(1, min(most, -(-3 * L2_BYTES // max(1, bytes_per_set))))


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def graph_us(calls: Sequence[Callable[[], object]], reps: int = 20) -> float:
    """Median GPU microseconds of one call, from replays of a graph holding every call of `calls` once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                   # warm-up (compiles, allocator) outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return _median(times)


def eager_us(calls: Sequence[Callable[[], object]], reps: int = 20) -> float:
    """Median microseconds of one call launched from Python, the calls back to back (launch cost included
    wherever it exceeds the GPU's time)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for call in calls:
            call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return _median(times)
