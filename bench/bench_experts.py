#!/usr/bin/env python
"""Forward-step time with the FFNs on expert shards (one batched RPC per shard per layer) against in-process, on the
default model, and the bytes that cross the wire.

    .venv/bin/python bench/bench_experts.py [--shards 2] [--batch 1 8 32] [--steps 16] [--shard-threads 1]
    .venv/bin/python bench/bench_experts.py --rebalance [--shards 2]

--rebalance: expert load imbalance (busiest shard / mean shard) before and after the automatic rebalancer, on a
skewed workload: a tiny DeepSeek-V3 (shared/testing/moe_checkpoints.py) whose correction bias sends every token
to experts 0 and 1, both on shard 0. Shard loads are the slots each shard process computed (its Info), dense layer
0's slices included; the rebalancer's own figure is the expected load of the worst MoE layer from the measured
expert load.

Napkin maths: a dense layer split over N shards sends every shard the step's hidden states and gets a partial sum
back, so each token costs 2 * N * D * 4 bytes per layer in fp32 (D = 576: 9,216 bytes for N = 2), plus a few bytes of
slot ids. Step time adds N concurrent round trips per layer (30 layers): on one machine the RPC latency, not the
bytes, is the price.

Both sides run with OMP_WAIT_POLICY=PASSIVE (what `upesi serve --expert-shards` sets): OpenMP workers spinning while
the target waits on RPCs would take the shards' cores.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")                  # before torch loads OpenMP

from bench.bench_generate import PROMPTS  # noqa: E402
from shared.testing.stack import free_port  # noqa: E402


def decode_step_times(eng, prompts: list[list[int]], steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of a batch of len(prompts) sequences (after their prefill)."""
    from shared.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    while any(s.num_output_tokens == 0 for rid in ids for s in eng.requests[rid]):
        eng.step()                                                   # prefill (maybe chunked)
    times = []
    for _ in range(steps):
        eng.step()
        times.append(eng.last_step_s)
    for rid in ids:
        eng.abort(rid)
    return times


def _start_shards(n: int, threads: int, model: str | None = None) -> tuple[list[str], list[subprocess.Popen]]:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    more = ["--model", model] if model else []
    return addresses, [subprocess.Popen([sys.executable, "-m", "services.cli", "--log-level", "WARNING", "experts",
                                         "--address", addr, "--shard-index", str(i), "--num-shards", str(n),
                                         "--num-threads", str(threads), *more], cwd=ROOT)
                       for i, addr in enumerate(addresses)]


def rebalance(a: argparse.Namespace) -> None:
    """Shard load imbalance on a skewed workload, before and after one round of the automatic rebalancer."""
    import tempfile

    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.model.placement import Placement
    from shared.sampling_params import SamplingParams
    from shared.shards.client import ExpertsClient
    from shared.shards.remote_ffn import attach_expert_shards, ffn_kinds
    from shared.shards.rebalance import Rebalancer
    from shared.testing.moe_checkpoints import save_tiny

    path = tempfile.mkdtemp(prefix="upesi-skewed-")
    save_tiny(path, "deepseek_v3_skewed")
    addresses, shards = _start_shards(a.shards, a.shard_threads, path)
    try:
        eng = LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=256, num_threads=a.threads,
                                     enable_prefix_caching=False))          # both phases do the same work
        client = ExpertsClient(addresses, Placement(a.shards, 8), ffn_kinds(eng.runner.model))
        client.wait_ready(eng.model_cfg, timeout_s=600)
        attach_expert_shards(eng.runner.model, client)
        prompts = [[(7 * i + 3 * j) % 100 + 1 for j in range(24)] for i in range(16)]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

        def slots() -> list[int]:
            return [i.slots for i in client.shard_info()]

        def workload() -> tuple[list[int], list, float]:
            s0, t0 = slots(), time.perf_counter()
            out = eng.generate(prompts, params)
            dt = time.perf_counter() - t0
            return [b - a for a, b in zip(s0, slots())], out, dt

        result = {}
        rb = Rebalancer(client, interval_s=1.0, threshold=1.25, extra=2, min_tokens=1)
        for phase in ("before", "after"):
            per_shard, out, dt = workload()
            result[phase] = {"shard_slots": per_shard,
                             "imbalance": round(max(per_shard) / statistics.mean(per_shard), 3),
                             "expected_worst_layer": round(max(rb.imbalances().values()), 3),
                             "seconds": round(dt, 2), "tokens": out}
            if phase == "before":
                fired = rb.check()
        same = result["before"].pop("tokens") == result["after"].pop("tokens")
        for phase, r in result.items():
            print(f"{phase:6s}: shard slots {r['shard_slots']}  max/mean {r['imbalance']:.2f}  (rebalancer's "
                  f"expected worst MoE layer {r['expected_worst_layer']:.2f})  "
                  f"{len(prompts)} x 32 tokens in {r['seconds']:.2f} s", flush=True)
        print(json.dumps({"rebalance": result, "fired": fired, "history": rb.history, "greedy_tokens_unchanged": same,
                          "shards": a.shards, "placement": client.placement.to_json()}, default=str))
        client.close()
    finally:
        for p in shards:
            p.send_signal(signal.SIGTERM)
        for p in shards:
            p.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the in-process engine (the target)")
    ap.add_argument("--shard-threads", type=int, default=1, help="torch threads of each shard")
    ap.add_argument("--rebalance", action="store_true", help="load imbalance before / after rebalancing instead")
    a = ap.parse_args()
    if a.rebalance:
        return rebalance(a)

    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.model.placement import Placement
    from shared.shards.client import ExpertsClient
    from shared.shards.remote_ffn import attach_expert_shards, ffn_kinds
    from shared.tokenizer import Tokenizer

    addresses, shards = _start_shards(a.shards, a.shard_threads)
    try:
        eng = LLMEngine(EngineConfig(progress=False, num_threads=a.threads, enable_prefix_caching=False,
                                     kv_cache_gb=0.5))
        tok = Tokenizer(eng.model_path)
        ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        cfg = eng.model_cfg
        decode_step_times(eng, ids[:1], 2)                           # warm-up
        local = {b: statistics.median(decode_step_times(eng, (ids * b)[:b], a.steps)) for b in a.batch}

        model = eng.runner.model
        client = ExpertsClient(addresses, Placement(a.shards), ffn_kinds(model))
        client.wait_ready(cfg, timeout_s=600)
        attach_expert_shards(model, client)
        decode_step_times(eng, ids[:1], 2)                           # warm-up: connections, shard allocators
        out = {}
        for b in a.batch:
            remote = statistics.median(decode_step_times(eng, (ids * b)[:b], a.steps))
            out[f"batch_{b}"] = {"in_process_ms": round(local[b] * 1e3, 2), "distributed_ms": round(remote * 1e3, 2),
                                 "slowdown": round(remote / local[b], 2),
                                 "overhead_per_layer_ms": round((remote - local[b]) / cfg.num_layers * 1e3, 3)}
            print(f"batch {b:3d}: in-process {local[b] * 1e3:8.2f} ms/step   {a.shards} shards {remote * 1e3:8.2f} "
                  f"ms/step   (x{remote / local[b]:.2f}, +{(remote - local[b]) / cfg.num_layers * 1e3:.3f} ms/layer)",
                  flush=True)
        tokens = client.tokens[True][0, 0].item()                      # tokens through layer 0 (prefills included)
        per_token_layer = (client.bytes_sent + client.bytes_received) / tokens / cfg.num_layers
        napkin = 2 * a.shards * cfg.hidden_size * 4
        print(f"wire: {per_token_layer:,.0f} bytes per token per layer (napkin {napkin:,}: 2 x {a.shards} shards x "
              f"{cfg.hidden_size} x 4 B); {client.num_rpcs} RPCs, {a.shards} per layer per step")
        print(json.dumps({"experts_step": out, "shards": a.shards, "wire_bytes_per_token_layer": round(per_token_layer),
                          "napkin_bytes_per_token_layer": napkin, "threads": a.threads,
                          "shard_threads": a.shard_threads,
                          "omp_wait_policy": os.environ["OMP_WAIT_POLICY"]}))
        client.close()
    finally:
        for p in shards:
            p.send_signal(signal.SIGTERM)
        for p in shards:
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
