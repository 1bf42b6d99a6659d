#!/usr/bin/env python
"""The cost of structured output: decode tokens/s of the engine on the default model with a JSON schema against
the same requests unconstrained, at 1 and 32 streams, side by side in one run (greedy, in process), and the share
of the constrained run's time spent in the grammar (masks and accepted tokens, timed inside the engine).

    .venv/bin/python bench/bench_structured.py [--streams 1 32] [--tokens 64] [--rounds 3]

Constrained requests end when their JSON does, so rates are per generated token; the grammar's share is the
direct measure of its cost. Figures, not assertions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine import structured  # noqa: E402
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


GRAMMAR_S = [0.0]                       # seconds inside the grammar's calls


def timed(fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            GRAMMAR_S[0] += time.perf_counter() - t0
    return wrapper


structured.mask_rows = timed(structured.mask_rows)
structured.Guide.apply = timed(structured.Guide.apply)
structured.Guide.accept = timed(structured.Guide.accept)
structured.Guide.rollback = timed(structured.Guide.rollback)


def rate(eng, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(tokens/s, the share of the time in the grammar)."""
    GRAMMAR_S[0] = 0.0
    t0 = time.perf_counter()
    out = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    return sum(len(o[0]) for o in out) / wall, GRAMMAR_S[0] / wall


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
        best, shares = {"free": 0.0, "json": 0.0}, []
        for _ in range(a.rounds):
            best["free"] = max(best["free"], rate(eng, prompts, free)[0])
            r, share = rate(eng, prompts, guided)
            best["json"] = max(best["json"], r)
            shares.append(share)
        print(f"{streams:>3} streams: unconstrained {best['free']:8.1f} tokens/s, JSON schema {best['json']:8.1f} "
              f"tokens/s; grammar {100 * min(shares):.1f}-{100 * max(shares):.1f}% of the constrained time",
              flush=True)


if __name__ == "__main__":
    main()
