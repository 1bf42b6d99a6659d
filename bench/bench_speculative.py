#!/usr/bin/env python
"""Speculative decoding through the running stack: tokens/s with and without speculation, mean accepted length,
and the measured speedup beside the bound (1 - a^(K+1)) / ((1 - a)(K c + 1)).

Each configuration is one `upesi serve` on the default model: router -> target (plain, and eagle-inproc / ngram
with the proposer inside the target), or router -> draft service -> Verify stream -> target (eagle-draft,
ngram-draft); requests are
greedy chat prompts with 128 new tokens (EOS ignored), sent one at a time (batch 1) and 8 at once (batch 8), after a
warm-up request. All the stacks run at once and are measured interleaved (the order rotates every round), so a
machine that slows down or speeds up shifts every configuration alike. Per configuration:
  tok/s                 completion tokens / wall time of the batch
  tau (mean accepted)   tokens emitted per target step = completion / (completion - accepted drafts)
  a                     per-token acceptance that gives tau at fixed K: (1 - a^(K+1)) / (1 - a) = tau
  c                     draft-to-target cost ratio: one head step / one target decode step, measured in-process
                        at batch 1 (eagle) on the same weights
  bound                 (1 - a^(K+1)) / ((1 - a)(K c + 1)), beside the measured speedup over `plain`

    .venv/bin/python bench/bench_speculative.py [--head models/eagle-smollm2-135m] [--k 4] [--tokens 128]
        [--configs plain eagle-draft eagle-inproc] [--threads 1] [--dtype auto] [--rounds 2]
    (a configuration NAME:DTYPE runs in that dtype, e.g. `--configs plain:float32 plain eagle-draft`; NAME-fixed,
    e.g. eagle-draft-fixed, always asks for K tokens instead of adapting K to each request's acceptance; NAME@X
    stops a draft below path probability X instead of the head's own setting, e.g. eagle-draft@0 never stops early;
    NAME/N drafts trees of N nodes for greedy requests instead of the head's own setting, NAME/0 chains;
    NAME+N speculates only while at most N sequences run, --speculative-max-seqs N; NAME*N runs the target's
    steps over 4 or more rows on N threads, --wide-threads N, e.g. plain*1 against the default of --wide-threads;
    NAME^N gives the draft service N torch threads, --draft-num-threads N (e.g. eagle-draft^2); NAME=DIR drafts
    with the head in DIR instead of --head, e.g. eagle-draft=/tmp/other-head)

Prints a table and one JSON line. Figures, not assertions: the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from shared.testing.stack import Stack, free_port  # noqa: E402

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "List five tips for staying healthy.",
    "What is photosynthesis?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Write a polite email asking a colleague for a meeting next week.",
    "What are the benefits of drinking water?",
]


def serve_args(name: str, head: str, k: int, threads: int, dtype: str, wide_threads: int) -> list[str]:
    """A configuration's `upesi serve` flags; NAME:DTYPE overrides --dtype for that one (e.g. plain:float32),
    NAME@X sets --draft-confidence X (e.g. eagle-draft@0: always the K drafts asked for), NAME/N sets
    --draft-tree-nodes N (e.g. eagle-draft/0: chains), NAME+N --speculative-max-seqs N, NAME*N --wide-threads N
    (else the bench's --wide-threads), NAME^N --draft-num-threads N, NAME=DIR the head in DIR."""
    name, _, other = name.partition("=")
    head = other or head
    name, _, own = name.partition(":")
    name, _, wide = name.partition("*")
    name, _, draft_threads = name.partition("^")
    name, _, max_seqs = name.partition("+")
    name, _, nodes = name.partition("/")
    name, _, conf = name.partition("@")
    base = ["--num-threads", str(threads), "--wide-threads", wide or str(wide_threads), "--num-speculative-tokens",
            str(k), "--dtype", own or dtype]
    if conf:
        base += ["--draft-confidence", conf]
    if nodes:
        base += ["--draft-tree-nodes", nodes]
    if max_seqs:
        base += ["--speculative-max-seqs", max_seqs]
    draft = ["--draft", f"eagle:{head}", "--draft-metrics-port", "0", "--draft-address", f"127.0.0.1:{free_port()}",
             *(["--draft-num-threads", draft_threads] if draft_threads else [])]
    ngram_draft = ["--draft", "ngram", "--draft-metrics-port", "0", "--draft-address", f"127.0.0.1:{free_port()}"]
    fixed = name.endswith("-fixed")                     # always K drafts (--adaptive-speculation false)
    name = name.removesuffix("-fixed")
    return base + ["--adaptive-speculation", str(not fixed).lower()] + {
        "plain": [], "eagle-draft": draft, "ngram-draft": ngram_draft,
        "eagle-inproc": ["--speculative", f"eagle:{head}"], "ngram": ["--speculative", "ngram"]}[name]


def run_batch(stub, prompts: list[str], tokens: int, k: int | None) -> tuple[float, int, int]:
    """Sends the prompts at once -> (wall s, completion tokens, accepted drafts)."""
    from upesi.v1 import generation_pb2 as pb

    def one(text: str):
        req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)], max_tokens=tokens,
                                 temperature=0, ignore_eos=True)
        if k is not None:
            req.num_speculative_tokens = k
        return stub.Generate(req, timeout=600)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        out = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    return wall, sum(r.usage.completion_tokens for r in out), sum(r.spec.accepted_tokens for r in out)


def measure_stacks(args) -> dict[str, dict[str, dict[str, float]]]:
    """Starts one stack per configuration (all at once: idle ones cost no CPU), then measures them interleaved,
    rotating the order every round, so that a machine getting slower or faster shifts every configuration alike."""
    import grpc

    from upesi.v1 import generation_pb2_grpc

    stacks, channels, stubs = {}, [], {}
    try:
        for name in args.configs:
            tmp = Path(tempfile.mkdtemp(prefix=f"bench-spec-{name.replace('/', '_')}-"))
            stacks[name] = Stack(tmp, serve_args(name, args.head, args.k, args.threads, args.dtype,
                                                 args.wide_threads))
        for name, stack in stacks.items():
            stack.wait_ready(600)
            channels.append(grpc.insecure_channel(stack.address))
            stubs[name] = generation_pb2_grpc.GenerationStub(channels[-1])
            run_batch(stubs[name], PROMPTS[:1], args.tokens, None)                    # warm-up
        sums = {name: {b: [0.0, 0, 0] for b in args.batches} for name in args.configs}
        for rnd in range(args.rounds):
            order = args.configs[rnd % len(args.configs):] + args.configs[:rnd % len(args.configs)]
            for batch in args.batches:
                n = 1 if batch > 1 else args.batch1_requests
                for j in range(n):
                    i = ((rnd * n + j) * batch) % len(PROMPTS)
                    for name in order:
                        w, t, a = run_batch(stubs[name], (PROMPTS * 2)[i:i + batch], args.tokens, args.request_k)
                        acc = sums[name][batch]
                        acc[0], acc[1], acc[2] = acc[0] + w, acc[1] + t, acc[2] + a
        return {name: {f"b{b}": {"tok_s": t / w, "tau": t / max(1, t - a)} for b, (w, t, a) in per.items()}
                for name, per in sums.items()}
    finally:
        for ch in channels:
            ch.close()
        for stack in stacks.values():
            stack.stop()


def measure_cost_ratio(head: str, k: int, threads: int, dtype: str, reps: int = 20, tree_nodes: int = 0) -> float:
    """c = (one eagle head step) / (one target decode step), batch 1, in this process, same weights; a chain of k
    drafts (tree_nodes = 0) or a tree of tree_nodes nodes and depth k."""
    import torch

    from shared.engine.config import EngineConfig, serving_dtype
    from shared.sampling_params import SamplingParams
    from shared.spec.factory import build_engine

    torch.set_num_threads(threads)
    eng = build_engine(EngineConfig(progress=False, kv_cache_gb=0.25, speculative=f"eagle:{head}",
                                 dtype=serving_dtype(dtype, torch.device("cpu")),
                                 num_speculative_tokens=k, draft_tree_nodes=tree_nodes))
    prompt = list(range(100, 160))
    eng.add_request("c", prompt, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True,
                                                num_speculative_tokens=0))
    proposer, eng.proposer = eng.proposer, None
    eng.runner.capture_hidden()
    for _ in range(3):                                                  # prefill + warm-up
        eng.step()
    seq = eng.requests["c"][0]
    target_s, head_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        eng.step()                                                      # one plain decode step of the target
        target_s.append(time.perf_counter() - t0)
        proposer.release(seq.seq_id)
        hidden = eng.runner.last_hidden                                  # [1, D] of the last position
        proposer.accept_hidden(seq, len(seq) - 2, hidden)
        t0 = time.perf_counter()
        proposer.propose([seq], [k])                                    # k head steps (the first over 1 feature)
        head_s.append((time.perf_counter() - t0) / k)
    return sorted(head_s)[reps // 2] / sorted(target_s)[reps // 2]


def solve_a(tau: float, k: int) -> float:
    """a with (1 - a^(K+1)) / (1 - a) = tau (bisection; the left side grows with a)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default=str(ROOT / "models" / "eagle-smollm2-135m"))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="target threads (1 avoids OpenMP stalls on a busy machine)")
    p.add_argument("--wide-threads", type=int, default=os.cpu_count() or 1,
                   help="target threads of steps over 4 or more rows (a verification's K + 1 rows, prefill, big "
                        "batches: compute-bound where one-row decode steps are memory-bound); default: every core")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--batch1-requests", type=int, default=4, help="sequential requests measured at batch 1")
    p.add_argument("--configs", nargs="+", default=["plain", "eagle-draft", "eagle-inproc"])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the configurations")
    p.add_argument("--dtype", default="auto", help="the stacks' --dtype (auto: bf16 on CPUs with native bf16)")
    p.add_argument("--request-k", type=int, default=None,
                   help="num_speculative_tokens sent with every request (default: unset, so the router's guard "
                        "decides whether a request alone speculates; set it to measure the speculative path itself)")
    args = p.parse_args()
    from shared.spec.eagle_proposer import SERVING

    results = measure_stacks(args)
    c = measure_cost_ratio(args.head, args.k, args.threads, args.dtype)
    nodes = SERVING.tree_nodes                                                  # what the stacks draft by default
    c_tree = measure_cost_ratio(args.head, args.k, args.threads, args.dtype, tree_nodes=nodes) if nodes else c
    print(f"\ndefault model, greedy, {args.tokens} tokens, K = {args.k}, dtype {args.dtype}, c = {c:.3f} "
          f"(head step / target step; a depth of the head's {nodes}-node trees: {c_tree:.3f}; the bound is the "
          "chain's)")
    print(f"{'config':14} {'batch':>5} {'tok/s':>8} {'tau':>6} {'a':>6} {'speedup':>8} {'bound':>6}")
    rows = []
    for name, res in results.items():
        for b, r in res.items():
            base = results.get("plain", {}).get(b)           # the speedup is over plain at the run's --dtype
            a = solve_a(r["tau"], args.k)
            bound = (1 - a ** (args.k + 1)) / ((1 - a) * (args.k * c + 1)) if r["tau"] > 1 else 1.0
            speedup = r["tok_s"] / base["tok_s"] if base else float("nan")
            rows.append({"config": name, "batch": int(b[1:]), **r, "a": a, "speedup": speedup, "bound": bound})
            print(f"{name:14} {b[1:]:>5} {r['tok_s']:8.1f} {r['tau']:6.2f} {a:6.3f} {speedup:8.2f} {bound:6.2f}")
    print(json.dumps({"k": args.k, "tokens": args.tokens, "dtype": args.dtype, "c": c, "c_tree": c_tree,
                      "rows": rows}))


if __name__ == "__main__":
    main()
