#!/usr/bin/env python
"""Why bf16 makes speculative verification cheap on CPU: the time of one forward step's linear layers on the
default model's shapes (30 layers of qkv 576->960, o 576->576, gate/up 576->2x1536, down 1536->576; fresh weights
per layer, so they stream from memory as in serving), by rows in the step (1 = a decode, K + 1 = verifying K drafts)
and by dtype; `bf16-packed` is bf16 with the weights prepacked for oneDNN, as the services run bf16 on CPU
(shared.ops.packed_linear: same kernel and results, no per-call weight reorder); `f32-rows` is fp32 in the panels
of the AVX2 rows kernel, as the services run fp32 where it is available (shared.ops.rows_gemm).

    .venv/bin/python bench/bench_matmul_rows.py [--threads 1] [--rows 1 2 5 8 16] [--reps 10]

Prints ms per step and the ratio to the 1-row step of the same dtype. Figures, not assertions.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.ops import rows_gemm  # noqa: E402
from shared.ops.packed_linear import pack_weight, packed_linear, packing_available  # noqa: E402

SHAPES = [(960, 576), (576, 576), (2 * 1536, 576), (576, 1536)]          # (out, in) of each linear of a layer


def step_ms(layers: list[list[torch.Tensor]], rows: int, reps: int, packed: bool = False) -> float:
    """ms per step of the layers' matmuls at `rows` rows (packed: through shared.ops.packed_linear)."""
    dtype = layers[0][0].dtype
    xs = {k: torch.randn(rows, k, dtype=dtype) for k in (576, 1536)}
    ops = [[(w.shape[1], pack_weight(w) if packed else w) for w in ws] for ws in layers]
    linear = packed_linear if packed else F.linear

    def go() -> None:
        for ws in ops:
            for k, w in ws:
                linear(xs[k], w)
    go()
    t0 = time.perf_counter()
    for _ in range(reps):
        go()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'dtype':11} {'rows':>4} {'ms/step':>8} {'vs 1 row':>8}")
    kinds = [("float32", torch.float32, False), ("bfloat16", torch.bfloat16, False)]
    kinds += [("bf16-packed", torch.bfloat16, True)] if packing_available() else []
    kinds += [("f32-rows", torch.float32, True)] if rows_gemm.available() else []
    for name, dtype, packed in kinds:
        layers = [[torch.randn(o, i, dtype=dtype) for o, i in SHAPES] for _ in range(args.layers)]
        base = None
        for rows in args.rows:
            ms = step_ms(layers, rows, args.reps, packed)
            base = base or ms
            print(f"{name:11} {rows:>4} {ms:8.1f} {ms / base:8.2f}", flush=True)


if __name__ == "__main__":
    main()
