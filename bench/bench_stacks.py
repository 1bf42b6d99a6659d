#!/usr/bin/env python
"""Stacks already running, side by side: default and plain requests of one workload, alternating between the stacks.

For comparing deployments that bench_peers.py cannot start itself: two checkouts of the project (a change and the
commit before it, each `upesi serve` from its own folder on its own ports), or stacks on other machines. Each round
sends every prompt of the workload to every stack twice, once leaving K to the deployment ("default") and once with
`num_speculative_tokens: 0` ("plain"), one request at a time, greedy, EOS ignored; a first round warms the stacks
(and their prefix caches) and is not counted. A machine that slows down or speeds up shifts every stack alike.

    .venv/bin/python bench/bench_stacks.py --address 127.0.0.1:47600,127.0.0.1:47700 [--workload grounded]
        [--rounds 3] [--tokens 128]

Prints tokens/s per stack and kind, each stack's default / plain, and one JSON line. Figures, not assertions.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import WORKLOADS  # noqa: E402


async def one(stub, prompt: str, k: int | None, tokens: int, salt: str) -> tuple[int, float]:
    """One streamed request -> (completion tokens, seconds)."""
    from upesi.v1 import generation_pb2 as pb
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)], max_tokens=tokens,
                             temperature=0, ignore_eos=True, cache_salt=salt)
    if k is not None:
        req.num_speculative_tokens = k
    t0, n = time.perf_counter(), 0
    async for msg in stub.GenerateStream(req, timeout=900):
        n += sum(len(c.token_ids) for c in msg.choices)
    return n, time.perf_counter() - t0


async def run(addresses: list[str], workload: str, rounds: int, tokens: int) -> dict[str, dict[str, float]]:
    import grpc

    from upesi.v1 import generation_pb2_grpc as pbg
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [pbg.GenerationStub(c) for c in channels]
    totals: dict[tuple[int, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for r in range(rounds + 1):                       # round 0 warms up
        for prompt in WORKLOADS[workload]:
            for i, stub in enumerate(stubs):
                for kind, k in (("default", None), ("plain", 0)):
                    # each stack and kind its own cache partition: a side never finds the other's prompts cached
                    n, dt = await one(stub, prompt, k, tokens, f"bench-stacks-{i}-{kind}")
                    if r:
                        totals[(i, kind)][0] += n
                        totals[(i, kind)][1] += dt
    for c in channels:
        await c.close()
    return {a: {kind: totals[(i, kind)][0] / totals[(i, kind)][1] for kind in ("default", "plain")}
            for i, a in enumerate(addresses)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", required=True, help="the stacks' router gRPC addresses, comma-separated")
    ap.add_argument("--workload", default="grounded", choices=sorted(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3, help="rounds counted (each: every prompt, stack and kind)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    a = ap.parse_args()
    addresses = [s.strip() for s in a.address.split(",") if s.strip()]
    rates = asyncio.run(run(addresses, a.workload, a.rounds, a.tokens))
    print(f"{a.workload} prompts, {a.tokens} greedy tokens, {a.rounds} rounds; tokens/s")
    for addr, r in rates.items():
        print(f"  {addr:24} default {r['default']:7.1f}  plain {r['plain']:7.1f}  "
              f"default / plain {r['default'] / r['plain']:.2f}x")
    print(json.dumps({"workload": a.workload, "tokens": a.tokens, "rounds": a.rounds, "tok_s": rates}))


if __name__ == "__main__":
    main()
