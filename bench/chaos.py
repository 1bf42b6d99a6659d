"""Chaos run: mixed load against a whole `upesi serve` stack while its parts are killed or frozen at random.

The stack: 2 target replicas, 2 expert shards that each hold every FFN slice (a replicated placement, so the
targets fail over to the other shard), the EAGLE draft service and a Redis prefix registry (its own redis-server),
on free ports. Worker threads send a mix of requests for --minutes: greedy streams, n = 2 sampled
requests, speculative and plain (num_speculative_tokens 0) ones, and streams the client cancels after a few chunks.
Every --kill-every-s seconds (on average) one victim is hit: an expert shard, the draft, the second target replica,
or Redis. A share --freeze-share of the hits freezes it (SIGSTOP, then SIGCONT --freeze-s later: a hung process,
which answers nothing); the others kill it with SIGKILL (Redis is restarted 5 s later; `upesi serve` restarts the
services itself). With --disk-kb the targets also keep a disk tier of KV blocks on a tmpfs of that size (root only),
which fills up.

It reports requests served, failed (by status, by the last kill before the failure, and whether a target replica
was killed while they ran), the KV
blocks each replica still holds once the load has stopped (leaks), and the processes left after the stack stopped.
Goal: failures only among requests that were running on a killed target; no request hangs past its deadline; no
leaked block or process. Figures, not assertions: `python bench/chaos.py --minutes 10 [--disk-kb 512]`.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.testing.redis_server import RedisServer  # noqa: E402
from shared.testing.stack import INTERNAL, ROOT, Stack, free_port  # noqa: E402
from upesi.v1 import generation_pb2 as pb  # noqa: E402
from upesi.v1 import generation_pb2_grpc, target_pb2, target_pb2_grpc  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash table works.",
           "List five tips for staying healthy.", "What is photosynthesis?", "Describe the water cycle.",
           "Give three reasons to learn a second language."]
KINDS = ("stream", "sampled-n2", "speculative", "plain", "cancelled")


@dataclass
class Outcome:
    kind: str
    start: float
    end: float
    status: str                     # "OK", "CANCELLED_BY_CLIENT" or a gRPC status name


@dataclass
class Chaos:
    kills: list[tuple[float, str]] = field(default_factory=list)      # (time, victim)
    lock: threading.Lock = field(default_factory=threading.Lock)


def children(pid: int) -> dict[str, list[int]]:
    """`upesi serve`'s child processes by role (router, target, draft, experts) -> pids, in start order."""
    out: dict[str, list[int]] = {}
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for kid in kids:
        try:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        role = cmd[3].decode() if len(cmd) > 3 else "?"
        out.setdefault(role, []).append(int(kid))
    return out


def one_request(stub, kind: str, rng: random.Random, max_tokens: int) -> str:
    prompt = rng.choice(PROMPTS)
    msgs = [pb.ChatMessage(role="user", content=prompt)]
    if kind == "sampled-n2":
        stub.Generate(pb.GenerateRequest(messages=msgs, max_tokens=max_tokens, temperature=0.8, n=2,
                                         seed=rng.randrange(1 << 30)), timeout=300)
        return "OK"
    req = pb.GenerateRequest(messages=msgs, max_tokens=max_tokens, temperature=0)
    if kind == "plain":
        req.num_speculative_tokens = 0
    stream = stub.GenerateStream(req, timeout=300)
    for i, _ in enumerate(stream):
        if kind == "cancelled" and i == 2:
            stream.cancel()
            return "CANCELLED_BY_CLIENT"
    return "OK"


def worker(address: str, stop: threading.Event, out: list[Outcome], seed: int, max_tokens: int) -> None:
    rng = random.Random(seed)
    with grpc.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while not stop.is_set():
            kind = rng.choice(KINDS)
            t0 = time.monotonic()
            try:
                status = one_request(stub, kind, rng, max_tokens)
            except grpc.RpcError as e:
                status = e.code().name
            out.append(Outcome(kind, t0, time.monotonic(), status))
            if status not in ("OK", "CANCELLED_BY_CLIENT"):
                stop.wait(0.5)                         # a client backs off after an error


def freeze(pid: int, seconds: float, stop: threading.Event) -> bool:
    """SIGSTOP, then SIGCONT after `seconds` (or at once when the run stops); False when pid is gone."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return False
    try:
        stop.wait(seconds)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return True


def chaos_monkey(stack: Stack, redis: RedisServer, stop: threading.Event, chaos: Chaos, every_s: float,
                 rng: random.Random, freeze_share: float, freeze_s: float) -> None:
    victims = ["experts", "experts", "draft", "target", "redis"]
    while not stop.wait(rng.uniform(0.5, 1.5) * every_s):
        victim = rng.choice(victims)
        frozen = rng.random() < freeze_share
        kids = children(stack.proc.pid)
        t = time.monotonic()
        if victim == "redis":
            with chaos.lock:
                chaos.kills.append((t, "redis frozen" if frozen else "redis"))
            if frozen:
                freeze(redis.pid, freeze_s, stop)
                continue
            redis.kill()
            stop.wait(5)
            redis.start()
            continue
        pids = kids.get(victim, [])
        if victim == "target":
            pids = pids[1:]                    # the second replica: the first serves while it restarts
        if not pids:
            continue
        pid = rng.choice(pids)
        with chaos.lock:
            chaos.kills.append((t, f"{victim} frozen" if frozen else victim))
        if frozen:
            freeze(pid, freeze_s, stop)
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def mount_tmpfs(path: Path, kb: int) -> Path:
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kb}k", "tmpfs", str(path)], check=True)
    return path


def target_loads(addresses: list[str]) -> dict[str, dict[str, int] | str]:
    out: dict[str, dict[str, int] | str] = {}
    for a in addresses:
        try:
            with grpc.insecure_channel(a) as ch:
                r = target_pb2_grpc.TargetStub(ch).Load(target_pb2.LoadRequest(), timeout=10, metadata=INTERNAL)
            out[a] = {"running": r.running, "waiting": r.waiting, "kv_blocks_used": r.kv_blocks_used}
        except grpc.RpcError as e:
            out[a] = e.code().name
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the load and the kills last")
    ap.add_argument("--concurrency", type=int, default=6, help="client threads sending requests")
    ap.add_argument("--kill-every-s", type=float, default=25.0, help="mean seconds between two kills")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-replicas", action="store_true", help="contiguous placement: each FFN slice on one shard")
    ap.add_argument("--freeze-share", type=float, default=0.5, help="the share of hits that freeze instead of kill")
    ap.add_argument("--freeze-s", type=float, default=8.0, help="how long a frozen victim stays stopped")
    ap.add_argument("--disk-kb", type=int, default=0, help="a disk tier on a tmpfs of this size (0: none; root)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="upesi-chaos-"))
    disk = mount_tmpfs(tmp / "disk", a.disk_kb) if a.disk_kb else None
    redis = RedisServer(tmp / "redis").start()
    base = free_port()
    targets = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]       # replica i listens on the first port + i
    extra = ["--target-replicas", "2", "--expert-shards", "2", "--registry", redis.url,
             "--draft", f"eagle:{ROOT / 'models' / 'eagle-smollm2-135m'}", "--num-speculative-tokens", "4",
             "--draft-address", f"127.0.0.1:{free_port()}", "--draft-metrics-port", "0",
             "--expert-metrics-port", "0", "--target-metrics-port", "0"]
    if not a.no_replicas:                     # every dense FFN slice on both shards
        extra += ["--expert-placement", "replicated"]
    if disk is not None:
        extra += ["--kv-disk-dir", str(disk), "--kv-disk-gb", str(a.disk_kb / 2**20)]
    t_start = time.monotonic()
    stack = Stack(tmp, extra=extra, target_address=targets[0])
    stop, chaos, outcomes = threading.Event(), Chaos(), []
    all_pids: set[int] = set()
    try:
        stack.wait_ready(600)
        print(f"stack up in {time.monotonic() - t_start:.0f} s: {children(stack.proc.pid)}", flush=True)
        threads = [threading.Thread(target=worker, args=(stack.address, stop, outcomes, a.seed + i, a.max_tokens))
                   for i in range(a.concurrency)]
        monkey = threading.Thread(target=chaos_monkey, args=(stack, redis, stop, chaos, a.kill_every_s, rng,
                                                             a.freeze_share, a.freeze_s))
        for t in [*threads, monkey]:
            t.start()
        deadline = time.monotonic() + a.minutes * 60
        while time.monotonic() < deadline:
            for pids in children(stack.proc.pid).values():
                all_pids.update(pids)
            time.sleep(2)
        stop.set()
        for t in [*threads, monkey]:
            t.join(timeout=360)
        if not redis.running:
            redis.start()
        time.sleep(10)                        # restarted services settle; aborted requests drain
        loads = target_loads(targets)
    finally:
        stop.set()
        for pids in children(stack.proc.pid).values():
            all_pids.update(pids)
        code = stack.stop()
        redis.stop()
        if disk is not None:
            subprocess.run(["umount", str(disk)], capture_output=True)
    time.sleep(2)
    left = sorted(p for p in all_pids | {stack.proc.pid} if Path(f"/proc/{p}").exists())
    target_kills = [t for t, v in chaos.kills if v == "target"]          # killed, not frozen
    by_status: Counter[str] = Counter()
    after_kill: Counter[str] = Counter()                 # failures by the last kill before them (within 60 s)
    failed_on_killed_target = failed_other = 0
    for o in outcomes:
        by_status[f"{o.kind}:{o.status}"] += 1
        if o.status not in ("OK", "CANCELLED_BY_CLIENT"):
            before = [v for t, v in chaos.kills if o.end - 60 <= t <= o.end]
            after_kill[before[-1] if before else "none"] += 1
            if any(o.start <= t <= o.end for t in target_kills):
                failed_on_killed_target += 1
            else:
                failed_other += 1
    served = sum(o.status in ("OK", "CANCELLED_BY_CLIENT") for o in outcomes)
    report = {"minutes": a.minutes, "requests": len(outcomes), "served": served,
              "failed_while_a_target_was_killed": failed_on_killed_target, "failed_other": failed_other,
              "kills": dict(Counter(v for _, v in chaos.kills)), "by_kind_and_status": dict(sorted(by_status.items())),
              "failures_by_last_kill": dict(after_kill),
              "targets_after_load": loads, "leaked_kv_blocks": sum(v["kv_blocks_used"] for v in loads.values()
                                                                   if isinstance(v, dict)),
              "serve_exit_code": code, "processes_left": left,
              "longest_request_s": round(max((o.end - o.start for o in outcomes), default=0.0), 1)}
    print(f"{len(outcomes)} requests in {a.minutes:g} min: {served} served, {failed_on_killed_target} failed while "
          f"a target replica was killed, {failed_other} failed otherwise; kills {report['kills']}; "
          f"KV blocks held after the load {report['leaked_kv_blocks']}; processes left {left}; failures by the "
          f"last kill before them: {dict(after_kill)}; longest request {report['longest_request_s']} s (deadline "
          "300 s)")
    for k, n in sorted(by_status.items()):
        print(f"  {k:<32} {n}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
