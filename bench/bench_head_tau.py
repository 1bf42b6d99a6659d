#!/usr/bin/env python
"""Mean accepted length (tau) of EAGLE heads in process, the quick way to compare trained heads.

Each head drafts for the default model inside one engine, greedy, K = 4, each prompt alone (batch 1, as the
benchmark's headline), 128 new tokens with EOS ignored, for every --nodes budget (0 = chains): on
bench/bench_speculative.py's 8 prompts (the same prompts and settings, so its tau through the stack should be
about the same) and on the first --held-out prompts of data/draft_prompts_self.txt after train-draft's seeded
shuffle (the prompts `upesi train-draft --prompts data/draft_prompts_self.txt` holds out).
tau = tokens emitted / target steps = completion / (completion - accepted drafts).

    .venv/bin/python bench/bench_head_tau.py [HEAD ...] [--nodes 8 16] [--dtype auto] [--held-out 8]

Prints one line per head and budget. Figures, not assertions.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_speculative import PROMPTS  # noqa: E402


def tau(engine, tok, texts: list[str], tokens: int) -> float:
    from shared.sampling_params import SamplingParams

    engine.stats_accepted, emitted = 0, 0
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, num_speculative_tokens=4)
    for text in texts:
        engine.generate([tok.apply_chat_template([{"role": "user", "content": text}])], params)
        emitted += tokens
    return emitted / (emitted - engine.stats_accepted)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("heads", nargs="*", default=[str(ROOT / "models" / "eagle-smollm2-135m")])
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 16], help="tree node budgets (0 = chains)")
    p.add_argument("--dtype", default="auto", help="serving dtype (auto: bf16 on CPUs with native bf16)")
    p.add_argument("--held-out", type=int, default=8, help="held-out self-instruct prompts (0 = none)")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()

    import torch

    from services.draft_data import read_prompts
    from shared.engine.config import EngineConfig, serving_dtype
    from shared.spec.factory import build_engine
    from shared.tokenizer import Tokenizer

    dtype = serving_dtype(args.dtype, torch.device("cpu"))
    held = read_prompts(str(ROOT / "data" / "draft_prompts_self.txt"))
    random.Random(0).shuffle(held)                             # train-draft's shuffle (seed 0): its held-out first
    sets = [("benchmark prompts", PROMPTS)] + ([("held-out self-instruct", held[:args.held_out])]
                                               if args.held_out else [])
    for head in args.heads:
        for nodes in args.nodes:
            eng = build_engine(EngineConfig(progress=False, kv_cache_gb=0.5, speculative=f"eagle:{head}",
                                         num_speculative_tokens=4, draft_tree_nodes=nodes, dtype=dtype))
            tok = Tokenizer(eng.model_path)
            t0 = time.perf_counter()
            figures = [f"{name} tau {tau(eng, tok, texts, args.tokens):.3f}" for name, texts in sets]
            print(f"{head} {dtype} {nodes} nodes: " + ", ".join(figures) + f" ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
            del eng


if __name__ == "__main__":
    main()
