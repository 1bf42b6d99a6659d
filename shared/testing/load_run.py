"""Load run: N concurrent streaming requests against a running stack for a fixed time; prints errors and figures.

    .venv/bin/upesi serve &                 # or any running stack
    .venv/bin/python shared/testing/load_run.py --address 127.0.0.1:50051 --concurrency 64 --duration 120

Each of the N workers sends one streaming request after another (a prompt drawn from a fixed varied set, sampled,
max_tokens drawn from [min, max]) until the time is up, then finishes its request in flight. Any RPC error counts.
With --metrics URL (a target's /metrics) it also reports the KV blocks still used once the run is over, which must
be 0. Exit status 1 when there were errors or leaked blocks, so scripts can use it.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import time
import urllib.request
from dataclasses import dataclass, field

import grpc

from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

PROMPTS = [
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three uses of a paperclip.",
    "What is the capital of Kenya, and what is it known for?",
    "Describe the water cycle to a child.",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Write the first line of a mystery novel.",
    "Summarise the plot of Romeo and Juliet.",
    "What are prime numbers? Give examples.",
    "Suggest a name for a pet turtle and explain why.",
    "How do airplanes stay in the air?",
]


@dataclass(slots=True)
class LoadResult:
    requests: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    kv_blocks_used_after: float | None = None

    def summary(self) -> str:
        ttft = sorted(self.ttft_s) or [float("nan")]
        p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
        lines = [f"requests {self.requests}, errors {len(self.errors)}, output tokens {self.tokens} in "
                 f"{self.duration_s:.0f} s = {self.tokens / max(self.duration_s, 1e-9):.1f} tok/s, "
                 f"{self.requests / max(self.duration_s, 1e-9):.2f} req/s",
                 f"time to first token: median {statistics.median(ttft):.2f} s, p99 {p99:.2f} s"]
        if self.kv_blocks_used_after is not None:
            lines.append(f"KV blocks used after the run: {self.kv_blocks_used_after:.0f}")
        lines += [f"error: {e}" for e in self.errors[:5]]
        return "\n".join(lines)


async def _worker(stub, result: LoadResult, stop_at: float, rng: random.Random, min_tokens: int,
                  max_tokens: int) -> None:
    while time.monotonic() < stop_at:
        req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=rng.choice(PROMPTS))],
                                 max_tokens=rng.randint(min_tokens, max_tokens), temperature=0.8,
                                 seed=rng.randrange(2**32))
        start, first = time.monotonic(), None
        try:
            async for msg in stub.GenerateStream(req, timeout=600):
                for c in msg.choices:
                    if c.token_ids and first is None:
                        first = time.monotonic() - start
                    result.tokens += len(c.token_ids)
            result.requests += 1
            if first is not None:
                result.ttft_s.append(first)
        except grpc.aio.AioRpcError as e:
            result.errors.append(f"{e.code().name}: {e.details()}")


def kv_blocks_used(metrics_url: str, settle_s: float = 10.0) -> float:
    """upesi_kv_blocks_used from a target's /metrics, waiting up to settle_s for it to reach 0."""
    deadline = time.monotonic() + settle_s
    while True:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        used = float(re.search(r"^upesi_kv_blocks_used(?:\{[^}]*\})? (\S+)$", text, re.M)[1])
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


async def run_load(address: str, concurrency: int, duration_s: float, min_tokens: int = 16, max_tokens: int = 64,
                   metrics_url: str | None = None, seed: int = 0) -> LoadResult:
    result = LoadResult()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        start = time.monotonic()
        await asyncio.gather(*(_worker(stub, result, start + duration_s, random.Random(seed + i), min_tokens,
                                       max_tokens) for i in range(concurrency)))
        result.duration_s = time.monotonic() - start
    if metrics_url:
        result.kv_blocks_used_after = kv_blocks_used(metrics_url)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="127.0.0.1:50051", help="router gRPC address (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent streams (default: %(default)s)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default: %(default)s)")
    p.add_argument("--min-tokens", type=int, default=16, help="shortest max_tokens drawn (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="longest max_tokens drawn (default: %(default)s)")
    p.add_argument("--metrics", default="http://127.0.0.1:8061/metrics",
                   help="a target's /metrics URL for the KV check after the run ('' = skip; default: %(default)s)")
    a = p.parse_args()
    result = asyncio.run(run_load(a.address, a.concurrency, a.duration, a.min_tokens, a.max_tokens,
                                  a.metrics or None))
    print(result.summary())
    raise SystemExit(1 if result.errors or result.kv_blocks_used_after else 0)


if __name__ == "__main__":
    main()
