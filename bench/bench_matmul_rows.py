#!/usr/bin/env python
"""Why bf16 makes speculative verification cheap on CPU: the time of one forward step's linear layers on the
default model's shapes (30 layers of qkv 576->960, o 576->576, gate/up 576->2x1536, down 1536->576; fresh weights
per layer, so they stream from memory as in serving), by rows in the step (1 = a decode, K + 1 = verifying K drafts)
and by dtype; `q4_1-packed` is the GGUF's Q4_1 layers kept packed, `nvfp4-packed` NVFP4's (shared.ops.qgemm:
AMX, else AVX512-BF16, else AVX2 in fp32); `bf16-packed` is bf16 as the services run it on this CPU
(shared.ops.packed_linear: the rows kernel's panels where AVX512-BF16 runs, taken by the AMX kernel where AMX runs,
else oneDNN's prepacked copy);
`bf16-onednn` oneDNN's prepacked copy, `bf16-avx512` and `bf16-amx` the two rows kernels on the same panels
(shared.ops.rows_gemm_bf16), each where it runs; `f32-rows` is fp32 in the panels of the AVX2 rows kernel, as the
services run fp32 where it is available (shared.ops.rows_gemm).

    .venv/bin/python bench/bench_matmul_rows.py [--threads 1] [--rows 1 2 5 8 16] [--reps 10] [--kinds bf16-amx]

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

from shared.ops import qgemm, rows_gemm, rows_gemm_bf16  # noqa: E402
from shared.ops.block_quant import example  # noqa: E402
from shared.ops.packed_linear import pack_weight, packed_linear, packing_available  # noqa: E402

SHAPES = [(960, 576), (576, 576), (2 * 1536, 576), (576, 1536)]          # (out, in) of each linear of a layer


def _kernel(fn):
    """(pack, linear) of one bf16 rows kernel's C function."""
    return (lambda w: (rows_gemm_bf16.pack(w), w.shape[0]),
            lambda x, pw: rows_gemm_bf16._call(fn, x, pw[0], pw[1], None))


def _kinds() -> dict:
    """name -> (dtype, pack, linear) of every way this machine runs a linear layer."""
    kinds = {"float32": (torch.float32, None, F.linear), "bfloat16": (torch.bfloat16, None, F.linear)}
    if packing_available():
        kinds["bf16-packed"] = (torch.bfloat16, pack_weight, packed_linear)
        kinds["bf16-onednn"] = (torch.bfloat16, lambda w: torch.ops.mkldnn._reorder_linear_weight(w),
                                lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    if rows_gemm_bf16.available():
        kinds["bf16-avx512"] = (torch.bfloat16, *_kernel(rows_gemm_bf16._lib().upesi_rows_gemm_bf16))
        if rows_gemm_bf16.uses_amx():
            kinds["bf16-amx"] = (torch.bfloat16, *_kernel(rows_gemm_bf16._amx_lib().upesi_rows_gemm_amx))
    if rows_gemm.available():
        kinds["f32-rows"] = (torch.float32, pack_weight, packed_linear)
    if qgemm.available():                                     # random Q4_1 codes of the weight's shape
        g = torch.Generator().manual_seed(0)
        kinds["q4_1-packed"] = (torch.bfloat16, lambda w: qgemm.QWeight(example("u4", *w.shape, 32, g, True)),
                                lambda x, w: qgemm.linear(x, w))
        kinds["nvfp4-packed"] = (torch.bfloat16, lambda w: qgemm.QWeight(example("nvfp4", *w.shape, 16, g, False)),
                                 lambda x, w: qgemm.linear(x, w))
    return kinds


def step_ms(layers: list[list[torch.Tensor]], rows: int, reps: int, pack=None, linear=F.linear) -> float:
    """ms per step of the layers' matmuls at `rows` rows (pack: each weight's packed form for `linear`)."""
    dtype = layers[0][0].dtype
    xs = {k: torch.randn(rows, k, dtype=dtype) for k in (576, 1536)}
    ops = [[(w.shape[1], pack(w) if pack else w) for w in ws] for ws in layers]

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
    p.add_argument("--kinds", nargs="+", help="only these (default: every kind this machine runs)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'kind':11} {'rows':>4} {'ms/step':>8} {'vs 1 row':>8}")
    for name, (dtype, pack, linear) in _kinds().items():
        if args.kinds and name not in args.kinds:
            continue
        layers = [[torch.randn(o, i, dtype=dtype) for o, i in SHAPES] for _ in range(args.layers)]
        base = None
        for rows in args.rows:
            ms = step_ms(layers, rows, args.reps, pack, linear)
            base = base or ms
            print(f"{name:11} {rows:>4} {ms:8.2f} {ms / base:8.2f}", flush=True)


if __name__ == "__main__":
    main()
