#!/usr/bin/env python
"""llama.cpp (llama-cpp-python) on the bench's prompts, run by bench/bench_peers.py with that install's own Python
(never imported here).

The prompts arrive as token ids (the chat template applied by Upesi's tokenizer, so both sides decode the same
context); each is decoded alone, greedy, `--tokens` new tokens with the end-of-sequence tokens banned (both sides
do the same work). Decoding uses `Llama.eval` and the argmax of the last position's logits read from the context
(llama.cpp keeps only that row unless every position's logits are asked for). Per prompt: tokens / wall seconds
from the first eval to the last token, the median of `--reps`; the mean over prompts; TTFT the median prompt eval.
Prints one JSON line: {"single": {"tok_s", "ttft_s", "cpu_s_per_tok"}}.

    LLAMACPP_PYTHON bench/peer_llamacpp.py --model FILE.gguf --prompts-json FILE [--threads 2] [--tokens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--prompts-json", required=True, help='{"ids": [[token ids], ...], "eos": [ids to ban]}')
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    spec = json.load(open(a.prompts_json))
    llm = Llama(model_path=a.model, n_ctx=2048, n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    vocab = llm.n_vocab()
    banned = list(spec["eos"])

    def decode(ids: list[int]) -> tuple[float, float]:
        """-> (seconds for the whole request, seconds to the first token)."""
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        ttft = None
        for i in range(a.tokens):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))
            logits = logits.copy()
            logits[banned] = -np.inf
            tok = int(logits.argmax())
            if ttft is None:
                ttft = time.perf_counter() - t0
            if i + 1 < a.tokens:
                llm.eval([tok])
        return time.perf_counter() - t0, ttft

    decode(spec["ids"][0])                                               # warm-up
    rates, ttfts = [], []
    c0 = time.process_time()
    for ids in spec["ids"]:
        runs = [decode(ids) for _ in range(a.reps)]
        rates.append(a.tokens / statistics.median(r[0] for r in runs))
        ttfts += [r[1] for r in runs]
    cpu = time.process_time() - c0
    n = a.tokens * a.reps * len(spec["ids"])
    print(json.dumps({"single": {"tok_s": statistics.mean(rates), "ttft_s": statistics.median(ttfts),
                                 "cpu_s_per_tok": cpu / n}}))


if __name__ == "__main__":
    main()
