#!/usr/bin/env python
"""The KV block store: time to first token from the store against recomputing, and P/D against aggregated targets.

    .venv/bin/python bench/bench_kv_store.py [--prompt-tokens 2000] [--reps 3] [--skip-pd | --only-pd]

Starts its own redis-server on a free port. Part 1, in process, the default model and dtype: the time to the first
token of a prompt of --prompt-tokens tokens
  - on an engine without a store (recompute),
  - on an engine with the store, whose blocks are not there yet (recompute + background writes), and the same
    with --kv-store-write-policy write_back (recompute; blocks are written only when the cache evicts them),
  - on a fresh engine whose prompt blocks another engine wrote to the store (read them, compute the last partial
    block), each with its own cache salt per repetition so nothing is reused from the local cache,
  - on an engine started after another wrote the prompt's blocks to the same disk directory (a restart).
Part 2, through running stacks (`upesi serve`): the same concurrent load of long, distinct prompts on two aggregated
targets and on one prefill target + one decode target (--prefill-replicas 1), the blocks handed over through the
Redis store (--kv-transfer store) or sent over gRPC to the decode target's host tier (--kv-transfer direct), each
target on --stack-threads threads, time to first token and tokens/s.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_peers import ServeStack, cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def ttft(engine, ids: list[int], salt: str) -> float:
    from shared.sampling_params import SamplingParams
    t0 = time.perf_counter()
    engine.add_request(f"ttft-{salt}", ids, SamplingParams(temperature=0, max_tokens=1, cache_salt=salt))
    first = None
    while engine.has_unfinished():
        for d in engine.step():
            if d.token_ids and first is None:
                first = time.perf_counter() - t0
    return first


def in_process(a: argparse.Namespace, url: str) -> dict:
    import torch

    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    cfg = dict(progress=False, dtype=a.dtype, num_threads=a.threads, kv_cache_gb=0.5)
    plain = LLMEngine(EngineConfig(**cfg))
    writer = LLMEngine(EngineConfig(**cfg, kv_store=url))
    reader = LLMEngine(EngineConfig(**cfg, kv_store=url))
    lazy = LLMEngine(EngineConfig(**cfg, kv_store=url, kv_store_write_policy="write_back"))
    vocab = plain.model_cfg.vocab_size
    ids = torch.randint(100, vocab - 1, (a.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    ttft(plain, ids[:64], "warm")
    ttft(reader, ids[:64], "warm")
    ttft(lazy, ids[:64], "warm")
    rows: dict[str, list[float]] = {"no store": [], "store, miss": [], "store, miss, write_back": [],
                                    "store, hit": []}
    for rep in range(a.reps):
        rows["no store"].append(ttft(plain, ids, f"plain-{rep}"))
        rows["store, miss"].append(ttft(reader, ids, f"miss-{rep}"))
        reader.kv_store.flush()
        rows["store, miss, write_back"].append(ttft(lazy, ids, f"lazy-{rep}"))
        ttft(writer, ids, f"hit-{rep}")
        writer.kv_store.flush()
        rows["store, hit"].append(ttft(reader, ids, f"hit-{rep}"))
        reader.kv_store.flush()
    disk = tempfile.mkdtemp(prefix="upesi-bench-kv-disk-")
    rows["disk, hit after a restart"] = []
    for rep in range(a.reps):                            # an engine writes to disk, a new one (a restart) reads
        first = LLMEngine(EngineConfig(**cfg, kv_disk_dir=disk))
        ttft(first, ids, f"disk-{rep}")
        first.close()
        again = LLMEngine(EngineConfig(**cfg, kv_disk_dir=disk))
        rows["disk, hit after a restart"].append(ttft(again, ids, f"disk-{rep}"))
        again.close()
    shutil.rmtree(disk, ignore_errors=True)
    from shared.kv.block_codec import BlockData, encode
    layout = reader.kv_store.layout
    value = encode(0, layout, BlockData(torch.zeros(layout.kv_shape, dtype=layout.dtype)))
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["bytes_per_token"] = len(value) / layout.block_size
    out["dtype"] = str(layout.dtype).removeprefix("torch.")
    for e in (plain, writer, reader, lazy):
        e.close()
    return out


def long_prompts(n: int, words: int) -> list[str]:
    lines = (ROOT / "data" / "draft_prompts_large.txt").read_text().split()
    return [" ".join(lines[i * words:(i + 1) * words]) for i in range(n)]


def stacks(a: argparse.Namespace, url: str) -> dict:
    prompts = long_prompts(a.concurrency, a.pd_words)
    out = {}
    for name, args in (("aggregated, 2 targets", ["--target-replicas", "2"]),
                       ("P/D through the store",
                        ["--prefill-replicas", "1", "--kv-transfer", "store", "--kv-store", url]),
                       ("P/D, direct (gRPC)", ["--prefill-replicas", "1", "--kv-transfer", "direct"])):
        stack = ServeStack(["--dtype", a.dtype, "--num-threads", str(a.stack_threads), *args])
        try:
            stack.run(["Hello there."], 8, 0)                                           # warm-up
            runs = [stack.run([f"{i}-{rep} {p}" for i, p in enumerate(prompts)], a.pd_tokens, 0)
                    for rep in range(a.reps)]
            out[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        finally:
            stack.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-pd", action="store_true", help="only the in-process part")
    ap.add_argument("--only-pd", action="store_true", help="only the stacks (P/D) part")
    ap.add_argument("--concurrency", type=int, default=4, help="P/D part: requests at once")
    ap.add_argument("--pd-words", type=int, default=600, help="P/D part: words per prompt")
    ap.add_argument("--pd-tokens", type=int, default=64, help="P/D part: tokens generated per request")
    ap.add_argument("--stack-threads", type=int, default=1,
                    help="P/D part: torch threads per target (two targets share the cores)")
    a = ap.parse_args()

    from shared.testing.redis_server import RedisServer
    server = RedisServer(Path(tempfile.mkdtemp(prefix="upesi-bench-kv-"))).start()
    try:
        print(f"{cpu_name()}; redis-server on {server.url}", flush=True)
        if not a.only_pd:
            r = in_process(a, server.url)
            print(f"\nTime to first token of a {a.prompt_tokens}-token prompt, in process ({r['dtype']}), median "
                  f"of {a.reps}:")
            base = r["no store"]
            for k in ("no store", "store, miss", "store, miss, write_back", "store, hit", "disk, hit after a restart"):
                print(f"  {k:26s} {r[k] * 1000:9.1f} ms   {r[k] / base:5.2f}x")
            print(f"  store bytes per token: {r['bytes_per_token']:.0f}")
        if not a.skip_pd:
            s = stacks(a, server.url)
            print(f"\n{a.concurrency} concurrent requests of ~{a.pd_words} words, {a.pd_tokens} tokens each, "
                  f"through the stack (median of {a.reps}):")
            for name, v in s.items():
                print(f"  {name:28s} {v['tok_s']:7.1f} tok/s   TTFT {v['ttft_s'] * 1000:8.1f} ms   "
                      f"CPU {v['cpu_s_per_tok'] * 1000:5.1f} ms/token")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
