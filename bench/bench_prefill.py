#!/usr/bin/env python
"""Time to prefill a long prompt, in process: the default model's packed 4-bit weights against the same file
dequantised to bf16 at load, and the packed weights multiplied through their codes for every row (the path below
shared.ops.qgemm.WIDE_ROWS rows).

Each configuration gets its own engine (bf16, prefix caching off, chunks of up to 2,048 tokens); each prompt is a
fresh run of random token ids, `max_tokens: 1`; best of `--reps`. Figures, not assertions.

    .venv/bin/python bench/bench_prefill.py [--lengths 512 2000] [--reps 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()

    import torch

    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.ops import qgemm
    from shared.sampling_params import SamplingParams
    wide = qgemm.WIDE_ROWS
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=1)
    results: dict[str, dict[int, float]] = {}
    for name, dequantise, rows in (("packed", False, wide), ("packed, codes for every row", False, 10**9),
                                   ("bf16 weights", True, wide)):
        eng = LLMEngine(EngineConfig(num_threads=a.threads, dtype="bfloat16", progress=False, kv_cache_gb=1.0,
                                     dequantise_gguf=dequantise, enable_prefix_caching=False,
                                     max_num_batched_tokens=2048))
        qgemm.WIDE_ROWS = rows
        eng.generate([torch.randint(100, 40000, (64,), generator=g).tolist()], params)          # warm-up
        results[name] = {}
        for n in a.lengths:
            best = float("inf")
            for _ in range(a.reps):
                ids = torch.randint(100, 40000, (n,), generator=g).tolist()
                t = time.perf_counter()
                eng.generate([ids], params)
                best = min(best, time.perf_counter() - t)
            results[name][n] = best
        qgemm.WIDE_ROWS = wide
        del eng
    print(f"{'prompt tokens':30}" + "".join(f"{n:>10}" for n in a.lengths))
    for name, r in results.items():
        print(f"{name:30}" + "".join(f"{r[n]:>9.3f}s" for n in a.lengths))
    print(json.dumps({"threads": a.threads, "results": results}))


if __name__ == "__main__":
    main()
