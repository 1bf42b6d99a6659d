#!/usr/bin/env python
"""Writes data/draft_prompts_self.txt: user requests written by the target itself (self-instruct).

The chat template is opened up to the start of a user turn and the target samples the user's message, one seeded
sample per line. What an instruct model writes there follows the requests it was tuned on: emails, recipes, code,
advice, explanations, in the free wording of real users, which the template prompts of build_draft_prompts.py lack.
Kept: messages the model ended itself (EOS within --max-tokens), 4 to 60 words, printable ASCII, no links, not a
prompt of bench/bench_speculative.py, each once (case-insensitive).

    .venv/bin/python data/self_instruct_prompts.py [--samples 4096] [--temperature 0.9] [--out F]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from data.build_draft_prompts import BENCH  # noqa: E402


def keep(text: str) -> bool:
    """The filter: a plain one-message request of 4..60 words."""
    words = text.split()
    return (4 <= len(words) <= 60 and all(32 <= ord(ch) < 127 or ch == "\n" for ch in text)
            and "http" not in text and "www." not in text and text not in BENCH)


def user_turn_prefix(tok) -> list[int]:
    """Token ids of the chat template up to where a user's message begins (the system turn and the user header)."""
    text = tok.hf.decode(tok.apply_chat_template([{"role": "user", "content": "\x00"}]), skip_special_tokens=False)
    return tok.encode(text[:text.index("\x00")])


def sample_requests(samples: int, temperature: float, max_tokens: int, batch: int, seed: int) -> list[str]:
    import torch
    from tqdm import tqdm

    from shared.engine.config import EngineConfig, serving_dtype
    from shared.engine.engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from shared.tokenizer import Tokenizer
    eng = LLMEngine(EngineConfig(progress=False, kv_cache_gb=1.0, max_num_seqs=batch,
                                 dtype=serving_dtype("auto", torch.device("cpu"))))
    tok = Tokenizer(eng.model_path)
    prefix = user_turn_prefix(tok)
    out: dict[str, list[int]] = {}
    ended: list[str] = []
    todo = list(range(samples))[::-1]
    with tqdm(total=samples, desc="user turns", unit="req") as bar:
        while todo or eng.has_unfinished():
            while todo and len(out) < batch:
                i = todo.pop()
                eng.add_request(str(i), prefix, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                               seed=seed * 1_000_003 + i))
                out[str(i)] = []
            for d in eng.step():
                out[d.request_id].extend(d.token_ids)
                if d.finish_reason:
                    ids = out.pop(d.request_id)
                    if d.finish_reason == "stop":
                        ended.append(tok.decode(ids).strip())
                    bar.update(1)
    return ended


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4096, help="user turns to sample (before the filter)")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--max-tokens", type=int, default=64, help="longer turns are dropped")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "draft_prompts_self.txt"))
    args = ap.parse_args()
    seen, kept = set(), []
    for text in sample_requests(args.samples, args.temperature, args.max_tokens, args.batch, args.seed):
        text = " ".join(text.split())                               # one line
        if keep(text) and text.lower() not in seen:
            seen.add(text.lower())
            kept.append(text)
    Path(args.out).write_text("\n".join(kept) + "\n")
    print(f"{len(kept)} of {args.samples} sampled requests kept -> {args.out}")


if __name__ == "__main__":
    main()
