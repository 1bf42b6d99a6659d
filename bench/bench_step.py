#!/usr/bin/env python
"""Where the milliseconds of one decode step go, in process, on the default model.

Runs the engine (the same class the target service runs) on one thread, the one that built it, at each batch size,
and splits the mean step into: scheduling and input preparation, each kind of module of the model (norms, the
attention block's projections, RoPE + KV store + attention, the MLP, the LM head), sampling and the rest of the
engine's bookkeeping. Modules are timed by wrapping their forward with a clock (about a microsecond each), so the
parts add up to slightly more than an untimed step, printed beside them. Through the running stack the same step
is `upesi_engine_step_seconds` on the target's /metrics; bench/bench_peers.py gives the tokens/s the client sees.

    .venv/bin/python bench/bench_step.py [--batch 1 4 32] [--dtype auto] [--steps 50] [--threads 2]
        [--speculative eagle:models/eagle-smollm2-135m --tree-nodes 8] [--dequantise-gguf] [--model DIR]
        [--int8-activations]

Prints a table (ms per step) and one JSON line. Figures, not assertions.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed_parts(eng) -> dict[str, float]:
    """Wraps the model's modules (by kind) and the runner's and engine's phases with clocks; returns the totals."""
    from shared.engine import engine as engine_mod
    totals: dict[str, float] = collections.defaultdict(float)

    def wrap(obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def clocked(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t
        setattr(obj, attr, clocked)

    model = eng.runner.model
    for layer in model.layers:
        wrap(layer.input_layernorm, "forward", "rms norms")
        wrap(layer.post_attention_layernorm, "forward", "rms norms")
        attn = layer.self_attn
        wrap(attn.qkv_proj, "forward", "qkv + o projections")
        wrap(attn.o_proj, "forward", "qkv + o projections")
        wrap(attn, "forward", "attention block (all)")
        wrap(layer.mlp, "forward", "mlp (gate_up, silu, down)")
        wrap(layer, "forward", "decoder layers (all)")
    wrap(model.norm, "forward", "rms norms")
    wrap(model, "compute_logits", "lm head")
    wrap(model, "forward", "model forward (all)")
    wrap(eng.runner, "prepare", "prepare inputs")
    wrap(eng.scheduler, "schedule", "schedule")
    wrap(engine_mod, "sample", "sample")
    if eng.proposer is not None:
        wrap(eng, "_propose", "propose (draft model)")
        wrap(eng, "_verify", "verify (acceptance, rollback)")
        wrap(eng, "_hand_hidden", "hand hidden states to the proposer")
    return totals


def run(eng, batch: int, steps: int, parts: dict[str, float] | None, workload: str = "generate") -> tuple[float, float]:
    """-> (seconds a step, tokens a sequence makes a step)."""
    from bench.bench_generate import PROMPTS
    from bench.workloads import WORKLOADS
    from shared.sampling_params import SamplingParams
    from shared.tokenizer import Tokenizer
    tok = Tokenizer(eng.model_path)
    prompts = PROMPTS if workload == "generate" else WORKLOADS[workload]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    k = eng.cfg.num_speculative_tokens if eng.proposer is not None else 0      # up to K + 1 tokens a step
    params = SamplingParams(temperature=0, max_tokens=steps * (k + 1) + 20, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{batch}-{i}", ids[i % len(ids)], params)
    for _ in range(10):                                        # prefill and a few decodes
        eng.step()
    if parts is not None:
        parts.clear()
    made = sum(len(s.output_ids) for s in eng.scheduler.running)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t) / steps
    made = sum(len(s.output_ids) for s in eng.scheduler.running) - made
    if parts is not None:
        parts.update(frozen=dict(parts))                      # the timed steps only, not the drain below
    while eng.has_unfinished():
        eng.step()
    return wall, made / (steps * batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--dtype", default="auto", help="auto: what the services serve on this CPU")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--int8-activations", action="store_true", help="quantised layers on int8 activations (W4A8)")
    ap.add_argument("--model", default=None, help="a checkpoint folder or .gguf (default: the bundled SmolLM2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dequantise-gguf", action="store_true", help="the GGUF's layers dequantised at load (bf16 "
                                                                    "weights) instead of packed")
    ap.add_argument("--speculative", default=None, help="a proposer inside the engine, e.g. "
                    "eagle:models/eagle-smollm2-135m (steps then verify its drafts)")
    ap.add_argument("--k", type=int, default=4, help="K with --speculative")
    ap.add_argument("--workload", default="generate", choices=["generate", "chat", "grounded", "mixed"],
                    help="prompts: bench_generate's, or bench/workloads.py's (grounded: answers that copy the prompt)")
    ap.add_argument("--tree-nodes", type=int, default=None, help="draft tree nodes with --speculative")
    a = ap.parse_args()

    import torch

    from shared.engine.config import EngineConfig, serving_dtype
    from shared.spec.factory import build_engine
    dtype = serving_dtype(a.dtype, torch.device("cpu"))
    eng = build_engine(EngineConfig(model=a.model, progress=False, dtype=dtype, num_threads=a.threads,
                                    speculative=a.speculative, num_speculative_tokens=a.k,
                                    draft_tree_nodes=a.tree_nodes,
                                    dequantise_gguf=a.dequantise_gguf,
                                    int8_activations=a.int8_activations))
    out = {}
    plains = {b: run(eng, b, a.steps, None, a.workload) for b in a.batch}   # untimed first, then clocked
    parts = timed_parts(eng)
    for b in a.batch:
        plain, tau = plains[b]
        clocked, _ = run(eng, b, a.steps, parts, a.workload)
        per = {k: 1e3 * v / a.steps for k, v in parts.pop("frozen").items()}
        out[f"batch_{b}"] = {"step_ms": 1e3 * plain, "step_ms_clocked": 1e3 * clocked, "tokens_per_step": tau,
                             "parts_ms": per}
        layers = per.get("decoder layers (all)", 0.0)
        inside = per.get("attention block (all)", 0.0) + per.get("mlp (gate_up, silu, down)", 0.0)
        print(f"\nbatch {b}: step {1e3 * plain:.2f} ms ({tau:.2f} tokens a sequence); clocked {1e3 * clocked:.2f} ms")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {k:34}{v:8.2f} ms")
        attn_rest = per.get("attention block (all)", 0) - per.get("qkv + o projections", 0)
        print(f"  {'= rope + kv store + attention':34}{attn_rest:8.2f} ms")
        print(f"  {'= layer glue (residuals, calls)':34}{layers - inside - per.get('rms norms', 0):8.2f} ms")
    print(json.dumps({"dtype": dtype, "threads": a.threads, **out}))


if __name__ == "__main__":
    main()
