#!/usr/bin/env python
"""Inter-token latency of the streams that do not need a frozen part of the stack, beside the same streams before it.

The stack of bench/chaos.py (2 target replicas, 2 expert shards that each hold every FFN slice, the EAGLE draft
service, a Redis prefix registry of its own). --streams client threads stream greedy chat requests back to back:
plain ones (num_speculative_tokens 0) and, one thread in four, speculative ones. For each victim in turn:
--before-s of load, the victim frozen (SIGSTOP) for --freeze-s, then thawed and --after-s to recover. Victims:

    draft    the draft service: plain streams do not need it; speculative ones fall back to plain decoding
    experts  one expert shard: every stream fails over to the other shard
    redis    the registry's redis-server: routing falls back to load only
    target   the second target replica: streams already on it stall until it thaws (counted, then left out); the
             router stops sending new ones to it

Per victim and window (before / frozen), over every gap between two chunks of one stream: p50 and p99 in ms, the
frozen window's p99 over the one before, streams that stalled (a gap over 2 s) and requests that failed.
Figures, not assertions (the machine is shared and noisy):

    .venv/bin/python bench/bench_freeze.py [--streams 8] [--freeze-s 8] [--victims draft experts redis target]

Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.chaos import PROMPTS, children  # noqa: E402
from shared.testing.redis_server import RedisServer  # noqa: E402
from shared.testing.stack import ROOT, Stack, free_port  # noqa: E402
from upesi.v1 import generation_pb2 as pb  # noqa: E402
from upesi.v1 import generation_pb2_grpc  # noqa: E402

STALL_S = 2.0           # a gap this long: the stream waited on the frozen part


@dataclass
class Stream:
    kind: str                                            # "plain" or "speculative"
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each chunk
    failed: str = ""                                     # the gRPC status of a failed request
    end: float = 0.0


def worker(address: str, kind: str, stop: threading.Event, out: list[Stream], max_tokens: int, seed: int) -> None:
    i = seed
    with grpc.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while not stop.is_set():
            s = Stream(kind)
            out.append(s)
            req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=PROMPTS[i % len(PROMPTS)])],
                                     max_tokens=max_tokens, temperature=0, ignore_eos=True)
            if kind == "plain":
                req.num_speculative_tokens = 0
            i += 1
            try:
                for _ in stub.GenerateStream(req, timeout=120):
                    s.arrivals.append(time.monotonic())
            except grpc.RpcError as e:
                s.failed = e.code().name
            s.end = time.monotonic()
            if s.failed:
                stop.wait(0.5)


def gaps(streams: list[Stream], lo: float, hi: float, kinds: tuple[str, ...],
         fail_until: float) -> tuple[list[float], int, int]:
    """Gaps (s) ending in [lo, hi) of the streams of `kinds` that did not stall (a gap over STALL_S overlapping the
    window: one that waited on the frozen part until it thawed); the streams that did; requests that failed from lo
    to fail_until."""
    out, stalled, failed = [], 0, 0
    for s in streams:
        if s.kind not in kinds:
            continue
        pairs = list(zip(s.arrivals, s.arrivals[1:]))
        if any(b - a > STALL_S and b >= lo and a < hi for a, b in pairs):
            stalled += 1
        else:
            out.extend(b - a for a, b in pairs if lo <= b < hi)
        failed += bool(s.failed) and lo <= s.end < fail_until
    return out, stalled, failed


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def victim_pid(stack: Stack, redis: RedisServer, victim: str) -> int:
    if victim == "redis":
        return redis.pid
    pids = children(stack.proc.pid).get(victim, [])
    return pids[-1]                              # the second target replica, the second shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--freeze-s", type=float, default=8.0)
    ap.add_argument("--before-s", type=float, default=12.0)
    ap.add_argument("--after-s", type=float, default=12.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--victims", nargs="+", default=["draft", "experts", "redis", "target"],
                    choices=["draft", "experts", "redis", "target"])
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="upesi-freeze-"))
    redis = RedisServer(tmp / "redis").start()
    extra = ["--target-replicas", "2", "--expert-shards", "2", "--expert-placement", "replicated",
             "--registry", redis.url, "--draft", f"eagle:{ROOT / 'models' / 'eagle-smollm2-135m'}",
             "--num-speculative-tokens", "4", "--draft-address", f"127.0.0.1:{free_port()}",
             "--draft-metrics-port", "0", "--expert-metrics-port", "0", "--target-metrics-port", "0"]
    stack = Stack(tmp, extra=extra)
    stop, streams, windows = threading.Event(), [], []
    kinds = ["speculative" if i % 4 == 3 else "plain" for i in range(a.streams)]
    try:
        stack.wait_ready(600)
        threads = [threading.Thread(target=worker, args=(stack.address, k, stop, streams, a.max_tokens, 7 * i))
                   for i, k in enumerate(kinds)]
        for t in threads:
            t.start()
        time.sleep(5)                                            # every stream running
        for victim in a.victims:
            t0 = time.monotonic()
            time.sleep(a.before_s)
            pid, t1 = victim_pid(stack, redis, victim), time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(a.freeze_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            windows.append((victim, t0, t1, time.monotonic()))
            time.sleep(a.after_s)
    finally:
        stop.set()
        code = stack.stop()
        redis.stop()
    rows = []
    for victim, t0, t1, t2 in windows:
        for who in ("plain",) if victim == "draft" else ("plain", "speculative"):
            before, _, fb = gaps(streams, t0, t1, (who,), t1)
            frozen, stalled, ff = gaps(streams, t1, t2, (who,), t2 + a.after_s)
            rows.append({"victim": victim, "streams": who, "p50_before_ms": pct(before, 0.5),
                         "p99_before_ms": pct(before, 0.99), "p50_frozen_ms": pct(frozen, 0.5),
                         "p99_frozen_ms": pct(frozen, 0.99), "stalled": stalled, "failed": fb + ff})
        if victim == "draft":                                    # speculative streams: fall back, not stall
            spec = [s for s in streams if s.kind == "speculative"]
            longest = max((b - a_ for s in spec for a_, b in zip(s.arrivals, s.arrivals[1:]) if b >= t1 and a_ < t2),
                          default=float("nan"))
            rows.append({"victim": victim, "streams": "speculative", "longest_gap_frozen_ms": longest * 1e3})
    failures = sorted({s.failed for s in streams if s.failed})
    print(f"{a.streams} streams ({kinds.count('speculative')} speculative), {a.max_tokens} tokens a request, "
          f"frozen {a.freeze_s:g} s; {len(streams)} requests, {sum(bool(s.failed) for s in streams)} failed "
          f"{failures}; `upesi serve` exited {code}")
    print(f"{'victim':<8} {'streams':<12} {'p50 before':>10} {'p99 before':>10} {'p50 frozen':>10} "
          f"{'p99 frozen':>10} {'p99 ratio':>9} {'stalled':>7} {'failed':>6}")
    for r in rows:
        if "longest_gap_frozen_ms" in r:
            print(f"{r['victim']:<8} {r['streams']:<12} longest gap while frozen {r['longest_gap_frozen_ms']:.0f} ms")
            continue
        ratio = r["p99_frozen_ms"] / r["p99_before_ms"]
        print(f"{r['victim']:<8} {r['streams']:<12} {r['p50_before_ms']:>10.1f} {r['p99_before_ms']:>10.1f} "
              f"{r['p50_frozen_ms']:>10.1f} {r['p99_frozen_ms']:>10.1f} {ratio:>8.2f}x {r['stalled']:>7} "
              f"{r['failed']:>6}")
    print(json.dumps({"streams": a.streams, "freeze_s": a.freeze_s, "rows": rows}))


if __name__ == "__main__":
    main()
