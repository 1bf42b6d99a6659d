#!/usr/bin/env python
"""vLLM's CPU build on the bench's prompts, run by bench/bench_peers.py with vLLM's own Python (never imported here).

One engine per process, in-process (no engine-core subprocess), every core as OpenMP threads, greedy, the chat
template applied by vLLM's tokenizer, `--tokens` new tokens (EOS ignored, so both sides do the same work):
  single : each prompt alone, tokens / wall seconds, TTFT from a 1-token request, CPU seconds per token
  c4, c32: the prompts x 1 and x 8 in one generate() call
With --ngram K the engine speculates with prompt lookup (K tokens) and only `single` is measured.
With --prefill N... only time to first token is measured: a fresh prompt of N random token ids (from a fixed seed),
`max_tokens: 1`, prefix caching off, best of --reps. Prints one JSON line.

    VLLM_PYTHON bench/peer_vllm.py --model HF_DIR --prompts-json FILE [--dtype bfloat16] [--ngram 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face folder of the same weights")
    ap.add_argument("--prompts-json", required=True, help="a JSON list of chat prompts (user messages)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--loads", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ngram", type=int, default=0, help="prompt-lookup speculation with K tokens (0 = off)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths: time to first token only")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if a.prefill:
        print(json.dumps(prefill(a)), flush=True)
        return
    from vllm import LLM, SamplingParams

    prompts = json.load(open(a.prompts_json))
    kwargs = dict(model=a.model, dtype=a.dtype, max_model_len=2048, seed=0, distributed_executor_backend="uni")
    if a.ngram:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": a.ngram,
                                        "prompt_lookup_max": 4}
    llm = LLM(**kwargs)
    tok = llm.get_tokenizer()
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in prompts]
    ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]
    full = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(batch: list[list[int]], sp) -> tuple[int, float, float]:
        llm.reset_prefix_cache()
        c, t = time.process_time(), time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": x} for x in batch], sp, use_tqdm=False)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        return sum(len(o.outputs[0].token_ids) for o in outs), wall, cpu

    run(ids[:1], full)                                                    # warm-up: compile, first-call costs
    run(ids, full)
    out: dict[str, dict[str, float]] = {}
    for load in ([1] if a.ngram else a.loads):
        if load == 1:
            rates, ttfts, cpus = [], [], []
            for x in ids:
                for _ in range(a.reps):
                    n, w, c = run([x], full)
                    rates.append(n / w)
                    cpus.append(c / n)
                    ttfts.append(run([x], first)[1])
            out["single"] = {"tok_s": statistics.mean(rates), "ttft_s": statistics.median(ttfts),
                             "cpu_s_per_tok": statistics.mean(cpus)}
            continue
        batch = (ids * load)[:load]
        best = None
        for _ in range(a.reps):
            n, w, c = run(batch, full)
            if best is None or n / w > best["tok_s"]:
                best = {"tok_s": n / w, "cpu_s_per_tok": c / n}
        best["ttft_s"] = run(batch, first)[1]
        out[f"c{load}"] = best
    print(json.dumps(out), flush=True)


def prefill(a: argparse.Namespace) -> dict[str, float]:
    """{length: seconds} to answer a prompt of that many token ids with one token (best of a.reps)."""
    import random

    from vllm import LLM, SamplingParams
    longest = max(a.prefill)
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=max(2048, longest + 16), seed=0,
              distributed_executor_backend="uni", enable_prefix_caching=False)
    rng = random.Random(0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(64)]}], one, use_tqdm=False)
    out = {}
    for n in a.prefill:
        best = float("inf")
        for _ in range(a.reps):
            ids = [rng.randrange(100, 40000) for _ in range(n)]
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        out[str(n)] = best
    return out


if __name__ == "__main__":
    main()
