#!/usr/bin/env python
"""The cost of structured output: decode tokens/s of the engine on the default model with a JSON schema against
the same requests unconstrained, at 1 and 32 streams, side by side in one run (greedy, in process).

    .venv/bin/python bench/bench_structured.py [--streams 1 32] [--tokens 64] [--rounds 3]

Constrained requests end when their JSON does, so rates are per generated token. Figures, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.config import EngineConfig  # noqa: E402
from shared.model_files import default_model_path  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402
from shared.spec.factory import build_engine  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                           "capital": {"type": "boolean"}, "tags": {"type": "array",
                                                                                     "items": {"type": "string"}}},
          "required": ["name", "country", "capital", "tags"]}
CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Cairo", "Hanoi", "Quito"]


def rate(eng, prompts: list[list[int]], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    out = eng.generate(prompts, params)
    return sum(len(o[0]) for o in out) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64, help="most new tokens a request")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each is reported")
    a = ap.parse_args()
    eng = build_engine(EngineConfig(progress=False))
    tok = Tokenizer(default_model_path())
    free = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=a.tokens, guide_kind="json_schema", guide=json.dumps(SCHEMA))
    for streams in a.streams:
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} "
                                             "as JSON."}]) for i in range(streams)]
        rate(eng, prompts[:1], guided)                                    # warm: the tokenizer table, compile
        best = {"free": 0.0, "json": 0.0}
        for _ in range(a.rounds):
            best["free"] = max(best["free"], rate(eng, prompts, free))
            best["json"] = max(best["json"], rate(eng, prompts, guided))
        print(f"{streams:>3} streams: unconstrained {best['free']:8.1f} tokens/s, JSON schema {best['json']:8.1f} "
              f"tokens/s ({100 * (1 - best['json'] / best['free']):+.1f}% slower)", flush=True)


if __name__ == "__main__":
    main()
