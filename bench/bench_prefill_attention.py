#!/usr/bin/env python
"""One layer's attention for a prompt chunk over a paged bf16 (or, with --dtype float32, fp32) cache, in ms: each
build of the prefill kernel this CPU runs (shared/ops/prefill_attention.c on AMX tiles, on AVX512-BF16 vectors; for
fp32 prefill_attention_f32.c on AVX2), torch's SDPA split and the row kernel the fused decoder uses for chunks of
at most 65 rows (shared/ops/cpu_attention.c); best of --reps.

A case is ROWSxPOSITIONS: the chunk's new rows, the last of the positions the cache holds (512x512 is a whole
512-token prompt; 16x5000 a paced chunk beside decodes late in a long prompt). The default model's heads (9 query
heads, 3 key heads of 64), blocks of 16. Beside the kernels' times, the kernel's useful GFLOP/s (causal scores and
weighted sums only). Figures, not assertions:

    .venv/bin/python bench/bench_prefill_attention.py [--cases 512x512 2000x2000 6000x6000 16x5000 64x5000]
        [--threads 2] [--reps 10] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.ops import cpu_attention, prefill_attention  # noqa: E402
from shared.ops.paged_attention import AttentionMetadata  # noqa: E402

H, KVH, DH, BS = 9, 3, 64, 16


def best_ms(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out) * 1e3


def case(n: int, length: int, reps: int, dtype: torch.dtype) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    nb = -(-length // BS) + 5
    k = torch.randn(nb, BS, KVH, DH, generator=g).to(dtype)
    v = torch.randn(nb, BS, KVH, DH, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[: -(-length // BS)]
    q = torch.randn(n, H, DH, generator=g).to(dtype)
    out = {}
    if dtype == torch.float32:
        if prefill_attention.supports_f32(q, k):
            out["avx2-f32"] = best_ms(lambda: prefill_attention.attention(q, k, v, table, length, DH ** -0.5), reps)
    else:
        lib = prefill_attention._lib
        try:
            for name, kernel in prefill_attention.kernels().items():
                prefill_attention._lib = lambda kernel=kernel: kernel
                out[name] = best_ms(lambda: prefill_attention.attention(q, k, v, table, length, DH ** -0.5), reps)
        finally:
            prefill_attention._lib = lib
    out["sdpa"] = best_ms(lambda: prefill_attention._sdpa(q, k, v, table, length, DH ** -0.5), reps)
    if n <= cpu_attention.MAX_ROWS and cpu_attention.supports(q, k):
        meta = AttentionMetadata(torch.zeros(n, dtype=torch.int64), table[None], torch.tensor([length]),
                                 torch.tensor([0, n]), 0, [n], [length], n, prompt_chunks=[False])
        out["rows"] = best_ms(lambda: cpu_attention.paged_attention(q, k, v, meta, DH ** -0.5), reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["512x512", "2000x2000", "6000x6000", "16x5000", "64x5000"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results = {}
    for c in a.cases:
        n, length = (int(x) for x in c.split("x"))
        r = results[c] = case(n, length, a.reps, getattr(torch, a.dtype))
        flop = 4 * H * DH * (n * (length - n) + n * (n + 1) / 2)          # q.k and p.v over each row's positions
        kernel = min((r[x] for x in ("amx", "avx512-bf16", "avx2-f32") if x in r), default=None)
        rate = f"; kernel {flop / kernel / 1e6:.0f} GFLOP/s" if kernel else ""
        print(f"{c:>10}: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in r.items()) + rate, flush=True)
    print(json.dumps({"threads": a.threads, "dtype": a.dtype, "ms": results}))


if __name__ == "__main__":
    main()
