#!/usr/bin/env python
"""Configurations of the Triton NVFP4 W4A16 kernels swept on a CUDA GPU, each checked against the dequantised
product first; prints per shape a bf16 matmul, the defaults and the best configuration found.

    python bench/sweep_nvfp4_tiles.py [--rows few|many|all] [--quick]

few (1-16 rows, decode): the GEMV kernel's (BLOCK_N, BLOCK_K, warps, stages) and K splits, beside the tiled
kernel's default; many (17+ rows): the tiled kernel's tiles. Times are the kernels' own (CUDA-graph replays,
weights rotated past the L2 cache; bench/cuda_timing.py), medians of 20. Figures, not assertions.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cuda_timing import graph_us, rotation  # noqa: E402
from shared.quant.nvfp4 import quantise_weight  # noqa: E402
from shared.quant.nvfp4_triton import nvfp4_gemv, nvfp4_matmul  # noqa: E402

FEW = [(1, 8192, 8192), (4, 8192, 8192), (16, 8192, 8192), (1, 28672, 8192), (1, 8192, 28672), (1, 3072, 576),
       (1, 576, 1536), (8, 4096, 4096)]
MANY = [(128, 8192, 8192), (2048, 8192, 8192), (64, 3072, 576)]


def gemv_configs(quick: bool):
    tiles = [(32, 128), (64, 128), (64, 256), (128, 128)] if quick else \
        [(16, 128), (32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128)]
    return [(bn, bk, nw, ns) for (bn, bk), nw, ns in itertools.product(tiles, [4, 8], [2, 3])]


def dot_configs(quick: bool):
    if quick:
        return [(64, 64, 64, 4, 3), (128, 64, 128, 8, 4), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3)]
    return list(itertools.product([64, 128], [64, 128], [64, 128], [4, 8], [3, 4]))


def ok(y: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(((y.float() - ref).abs() / (ref.abs() + 1)).max() < 2e-2)


def sweep_shape(m: int, n: int, k: int, few: bool, quick: bool) -> None:
    sets = rotation(n * k * 9 // 16)                                  # the NVFP4 bytes past L2
    ws = [torch.randn(n, k, device="cuda") for _ in range(sets)]
    qs, bs = [quantise_weight(w) for w in ws], [w.bfloat16() for w in ws]
    del ws
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ qs[0].dequantise(torch.float32).T
    bf16 = graph_us([lambda b=b: x @ b.T for b in bs])
    default = graph_us([lambda q=q: nvfp4_matmul(x, q) for q in qs])
    tiled = graph_us([lambda q=q: nvfp4_matmul(x, q, 32, 64, 64) for q in qs])
    best: tuple[float, object] = (default, "default")
    if few:
        for bn, bk, nw, ns in gemv_configs(quick):
            for split in (None, 1, 2, 4, 8):
                def run(q, bn=bn, bk=bk, nw=nw, ns=ns, split=split):
                    return nvfp4_gemv(x, q, bn, bk, split, nw, ns)
                try:
                    if not ok(run(qs[0]), ref):
                        print(f"  gemv {bn}x{bk} w{nw} s{ns} split {split}: wrong", flush=True)
                        continue
                    t = graph_us([lambda q=q: run(q) for q in qs])
                except Exception as e:                                       # out of resources, ...
                    print(f"  gemv {bn}x{bk} w{nw} s{ns} split {split}: {type(e).__name__}", flush=True)
                    continue
                best = min(best, (t, ("gemv", bn, bk, nw, ns, split)), key=lambda b: b[0])
    for bm, bn, bk, nw, ns in dot_configs(quick):
        if few and bm > 64:
            continue
        try:
            if not ok(nvfp4_matmul(x, qs[0], bm, bn, bk, nw, ns), ref):
                print(f"  tiled {bm}x{bn}x{bk} w{nw} s{ns}: wrong", flush=True)
                continue
            t = graph_us([lambda q=q: nvfp4_matmul(x, q, bm, bn, bk, nw, ns) for q in qs])
        except Exception as e:
            print(f"  tiled {bm}x{bn}x{bk} w{nw} s{ns}: {type(e).__name__}", flush=True)
            continue
        best = min(best, (t, ("tiled", bm, bn, bk, nw, ns)), key=lambda b: b[0])
    gbs = (n * k * 0.5625 + 2 * m * (k + n)) / (best[0] * 1e-6) / 1e9
    print(f"{m}x{n}x{k}: bf16 {bf16:.1f} | default {default:.1f} ({bf16 / default:.2f}x bf16) | tiled 32x64x64 "
          f"{tiled:.1f} | best {best[0]:.1f} {best[1]} ({gbs:.0f} GB/s, {bf16 / best[0]:.2f}x bf16)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", choices=["few", "many", "all"], default="all", help="which row counts to sweep")
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}; us per call, kernel time (graph replays)", flush=True)
    shapes = [(s, True) for s in FEW] * (args.rows != "many") + [(s, False) for s in MANY] * (args.rows != "few")
    for (m, n, k), few in shapes:
        sweep_shape(m, n, k, few, args.quick)


if __name__ == "__main__":
    main()
