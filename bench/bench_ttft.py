#!/usr/bin/env python
"""Time to first token of long prompts: Upesi as `make run` starts it, beside vLLM's CPU build, in one run.

Each prompt is a fresh run of random token ids (no prefix-cache hit on either side), `max_tokens: 1`, sent to the
stack's OpenAI endpoint (/v1/completions with token ids); the figure is the best of `--reps` wall times of the
whole request. vLLM runs in process (bench/peer_vllm.py --prefill: every core, prefix caching off, its default
chunked-prefill budget) in the stack's dtype, never at the same time as the stack.

With `--mixed N` a second figure: N streams decode (the chat prompts, greedy, EOS ignored) when a prompt of the
longest length arrives; their inter-token gaps while it prefills against before it (p50 / p99 over every stream),
and its time to first token against the same prompt length alone. Only the stack is measured this way.

With `--rounds R` the stack and vLLM take turns R times (each round restarts both): the table shows each side's
best over every round, and a line the Upesi / vLLM ratio of each round, whose two sides ran minutes apart rather
than a whole run apart (this host's speed drifts by the hour).

Beside the seconds: prefill tokens/s, and the arithmetic a prompt costs (every linear layer but the LM head, plus
causal attention's scores and weighted sums) as a fraction of this machine's measured matmul peak in that dtype
(the best of a few torch matmuls of the model's shapes, 2,048 rows, every core).

    .venv/bin/python bench/bench_ttft.py [--lengths 512 2000 6000] [--reps 3]
        [--vllm-python ~/.cache/upesi-vllm-peer/venv/bin/python --vllm-model ~/.cache/upesi-vllm-peer/smollm2-hf]
        [--mixed 8] [--rounds 3]

Prints a table and one JSON line. Figures, not assertions: the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_peers import PROMPTS, ServeStack, cpu_name, make_run_args, served_dtype  # noqa: E402


def prompt_flop(cfg, n: int) -> float:
    """Multiply-adds x 2 of prefilling n tokens: the decoder's linear layers and causal attention."""
    d, h, kvh, dh, inter = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    linear = d * (h + 2 * kvh) * dh + h * dh * d + 3 * d * inter
    attention = 2 * h * dh * n * (n + 1) / 2                     # q.k and p.v over each row's positions
    return cfg.num_layers * 2 * (linear * n + attention)


def matmul_peak(dtype: str, threads: int) -> float:
    """FLOP/s of this machine's best torch matmul among the model's linear shapes at 2,048 rows."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    best = 0.0
    for n, k in ((3072, 576), (576, 1536), (960, 576), (4096, 4096)):
        x, w = torch.randn(2048, k, dtype=getattr(torch, dtype)), torch.randn(n, k, dtype=getattr(torch, dtype))
        F.linear(x, w)
        t = time.perf_counter()
        for _ in range(5):
            F.linear(x, w)
        best = max(best, 5 * 2 * 2048 * n * k / (time.perf_counter() - t))
    return best


def measure_stack(a: argparse.Namespace, rng: random.Random,
                  with_mixed: bool = True) -> tuple[dict[str, float], dict[str, float] | None]:
    """{length: seconds} of prompts alone; with a.mixed (and with_mixed), the mixed-load figures too."""
    stack = ServeStack(shlex.split(a.serve_args) if a.serve_args is not None else make_run_args())
    url = f"http://127.0.0.1:{stack.http_port}/v1/completions"

    def ask(n: int) -> float:
        body = json.dumps({"prompt": [rng.randrange(100, 40000) for _ in range(n)], "max_tokens": 1,
                           "temperature": 0}).encode()
        t = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}),
                                    timeout=900) as r:
            r.read()
        return time.perf_counter() - t

    try:
        ask(64), ask(2048)                                           # warm-up: first calls of each path
        alone = {str(n): min(ask(n) for _ in range(a.reps)) for n in a.lengths}
        return alone, (measure_mixed(stack, ask, max(a.lengths), a.mixed) if a.mixed and with_mixed else None)
    finally:
        stack.close()


def measure_mixed(stack: ServeStack, ask, length: int, streams: int) -> dict[str, float]:
    """`streams` streams decode; once each has 48 tokens a `length`-token prompt arrives. Their gaps between tokens
    (from the 16th on) before it and while it prefills (p50 / p99 over every stream), and its time to first token."""
    from upesi.v1 import generation_pb2 as pb
    sent, answered = [0.0], [0.0]
    counts = [0] * streams

    async def stream(i: int, prompt: str) -> list[float]:
        req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)], max_tokens=1000,
                                 temperature=0, ignore_eos=True, num_speculative_tokens=0)
        times = []
        async for msg in stack.stub.GenerateStream(req, timeout=900):
            times += [time.perf_counter()] * sum(len(c.token_ids) for c in msg.choices)
            counts[i] = len(times)
        return times

    async def long_prompt() -> float:
        while min(counts) < 48:                                  # every stream 32 tokens past its 16th
            await asyncio.sleep(0.05)
        sent[0] = time.perf_counter()
        ttft = await asyncio.get_running_loop().run_in_executor(None, ask, length)
        answered[0] = sent[0] + ttft
        return ttft

    async def run() -> tuple[list[list[float]], float]:
        tasks = [asyncio.ensure_future(stream(i, p)) for i, p in enumerate((PROMPTS * streams)[:streams])]
        ttft = await long_prompt()
        return await asyncio.gather(*tasks), ttft

    times, ttft = stack.loop.run_until_complete(run())
    before, during = [], []
    for ts in times:
        for prev, t in zip(ts[16:], ts[17:]):
            (before if t < sent[0] else during if prev >= sent[0] and t <= answered[0] + 0.05 else []).append(t - prev)

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    return {"streams": streams, "length": length, "ttft_s": ttft, "itl_p50_before_s": pct(before, 0.5),
            "itl_p99_before_s": pct(before, 0.99), "itl_p50_during_s": pct(during, 0.5),
            "itl_p99_during_s": pct(during, 0.99), "gaps_during": len(during)}


def measure_vllm(a: argparse.Namespace, dtype: str) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false",
               VLLM_NO_USAGE_STATS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    iomp = Path(a.vllm_python).resolve().parents[1] / "lib" / "libiomp5.so"     # vLLM's recommended preload
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    cmd = [a.vllm_python, str(ROOT / "bench" / "peer_vllm.py"), "--model", a.vllm_model, "--prompts-json",
           os.devnull, "--dtype", dtype, "--reps", str(a.reps), "--prefill", *map(str, a.lengths)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode or not lines:
        raise RuntimeError(f"vLLM run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2000, 6000], help="prompt tokens")
    ap.add_argument("--reps", type=int, default=3, help="requests per length (best of)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of vLLM (default: every core)")
    ap.add_argument("--dtype", default="auto", help="the stack's --dtype; vLLM runs the dtype it resolves to")
    ap.add_argument("--serve-args", default=None, help="flags of `upesi serve` (default: the Makefile's SERVE_ARGS)")
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM CPU install (measures vLLM beside)")
    ap.add_argument("--vllm-model", default=None, help="Hugging Face folder of the default model, for vLLM")
    ap.add_argument("--mixed", type=int, default=0, help="streams decoding when the longest prompt arrives (0: none)")
    ap.add_argument("--rounds", type=int, default=1, help="turns of the stack and vLLM, one after the other")
    a = ap.parse_args()
    if a.serve_args is None and a.dtype != "auto":
        a.serve_args = shlex.join([*make_run_args(), "--dtype", a.dtype])

    from shared.model.loader import load_config
    from shared.model_files import default_model_path
    cfg = load_config(default_model_path())
    dtype = served_dtype(a.dtype)
    rng = random.Random(0)
    rounds: list[dict[str, dict[str, float]]] = []
    mixed = None
    for r in range(max(1, a.rounds)):
        upesi, got = measure_stack(a, rng, with_mixed=r == 0)
        if r == 0:
            mixed = got
        rounds.append({"upesi": upesi})
        if a.vllm_python:
            rounds[-1]["vllm"] = measure_vllm(a, dtype)
    results = {side: {n: min(one[side][n] for one in rounds) for n in rounds[0][side]} for side in rounds[0]}
    upesi = results["upesi"]
    peak = matmul_peak(dtype, a.threads)
    print(f"{cpu_name()}, {a.threads} threads, {dtype}; matmul peak {peak / 1e9:.0f} GFLOP/s")
    print(f"{'prompt tokens':>14} " + "".join(f"{name + ' s':>12}{'tok/s':>9}{'of peak':>9}" for name in results)
          + ("  Upesi/vLLM" if "vllm" in results else ""))
    for n in a.lengths:
        row = f"{n:>14} "
        for r in results.values():
            s = r[str(n)]
            row += f"{s:>12.3f}{n / s:>9.0f}{prompt_flop(cfg, n) / s / peak:>9.1%}"
        if "vllm" in results:
            row += f"  {results['upesi'][str(n)] / results['vllm'][str(n)]:>10.2f}x"
        print(row)
    if "vllm" in results and len(rounds) > 1:
        print("Upesi / vLLM by round: " + "; ".join(
            f"{n}: " + " ".join(f"{one['upesi'][str(n)] / one['vllm'][str(n)]:.2f}x" for one in rounds)
            for n in a.lengths))
    if mixed:
        n = str(mixed["length"])
        print(f"{mixed['streams']} streams decoding, a {n}-token prompt arrives: their gaps between tokens p50 / p99 "
              f"{mixed['itl_p50_before_s'] * 1e3:.1f} / {mixed['itl_p99_before_s'] * 1e3:.1f} ms before, "
              f"{mixed['itl_p50_during_s'] * 1e3:.1f} / {mixed['itl_p99_during_s'] * 1e3:.1f} ms while it prefills; "
              f"its first token after {mixed['ttft_s']:.3f} s ({mixed['ttft_s'] / upesi[n]:.2f}x alone)")
    print(json.dumps({"cpu": cpu_name(), "dtype": dtype, "matmul_peak_flops": peak, "results": results,
                      "rounds": rounds, "mixed": mixed}))


if __name__ == "__main__":
    main()
