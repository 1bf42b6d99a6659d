#!/usr/bin/env python
"""Tile sizes, warps and pipeline stages of the Triton NVFP4 W4A16 GEMM, swept on a CUDA GPU for each benchmark
shape of bench/bench_nvfp4.py; prints the best configuration per shape beside a bf16 matmul, after checking each
configuration's output against the dequantised product.

    python bench/sweep_nvfp4_tiles.py [--quick]

Figures, not assertions (CUDA events, median of 30 runs after warm-up).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.quant.nvfp4 import quantise_weight  # noqa: E402
from shared.quant.nvfp4_triton import nvfp4_matmul  # noqa: E402

SHAPES = [(1, 8192, 8192), (16, 8192, 8192), (128, 8192, 8192), (2048, 8192, 8192), (1, 3072, 576),
          (16, 576, 1536)]


def timed(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]                                    # us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    def configs(m: int):
        if m <= 16:                          # decode-like: one row tile, many column programs, long K steps
            return itertools.product([16], [16, 32, 64, 128], [64, 128, 256], [4], [2, 4])
        return itertools.product([64, 128], [64, 128], [64, 128], [4, 8], [3, 4])

    print(f"{torch.cuda.get_device_name()}; shape: the former default tile (32x64x64) us, "
          f"best us (bm, bn, bk, warps, stages), bf16 us")
    for m, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda")
        q = quantise_weight(w)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ q.dequantise(torch.float32).T
        base = timed(lambda: nvfp4_matmul(x, q, 32, 64, 64))
        wb = w.bfloat16()
        bf16 = timed(lambda: x @ wb.T)
        best = (base, None)
        for bm, bn, bk, nw, ns in configs(m):
            if args.quick and (bn, bk) not in ((32, 128), (64, 128), (128, 64)):
                continue
            try:
                y = nvfp4_matmul(x, q, bm, bn, bk, nw, ns)
            except Exception as e:                                           # out of shared memory, ...
                print(f"  {bm}x{bn}x{bk} w{nw} s{ns}: {type(e).__name__}")
                continue
            err = ((y.float() - ref).abs() / (ref.abs() + 1)).max().item()
            if err > 2e-2:
                print(f"  {bm}x{bn}x{bk} w{nw} s{ns}: wrong (rel err {err:.1e})")
                continue
            t = timed(lambda: nvfp4_matmul(x, q, bm, bn, bk, nw, ns))
            if t < best[0]:
                best = (t, (bm, bn, bk, nw, ns))
        gbs = (n * k * 0.5625 + 2 * m * (k + n)) / (best[0] * 1e-6) / 1e9
        print(f"{m}x{n}x{k}: default {base:.1f}, best {best[0]:.1f} {best[1]} ({gbs:.0f} GB/s), bf16 {bf16:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
