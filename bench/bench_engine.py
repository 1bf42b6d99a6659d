#!/usr/bin/env python
"""In-process engine decode throughput (no gRPC): the ceiling the stack is measured against.

    .venv/bin/python bench/bench_engine.py [--tokens 128] [--batch 1 4 16 32] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_generate import PROMPTS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="cProfile one batch-16 run")
    a = ap.parse_args()

    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from shared.tokenizer import Tokenizer

    eng = LLMEngine(EngineConfig(progress=False, dtype=a.dtype, num_threads=a.threads,
                                 enable_prefix_caching=False))
    tok = Tokenizer(eng.model_path)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    eng.generate(ids[:1], params)                                        # warm-up
    out = {}
    for b in a.batch:
        prompts = (ids * b)[:b]
        t = time.perf_counter()
        eng.generate(prompts, params)
        out[f"batch_{b}"] = round(b * a.tokens / (time.perf_counter() - t), 1)
        print(f"batch {b:3d}: {out[f'batch_{b}']:8.1f} tokens/s", flush=True)
    if a.profile:
        import cProfile
        import pstats
        cProfile.runctx("eng.generate((ids * 4)[:16], params)", globals(), locals(), "/tmp/upesi-engine.prof")
        pstats.Stats("/tmp/upesi-engine.prof").sort_stats("tottime").print_stats(20)
    print(json.dumps({"engine_in_process": out, "tokens": a.tokens, "dtype": a.dtype}))


if __name__ == "__main__":
    main()
