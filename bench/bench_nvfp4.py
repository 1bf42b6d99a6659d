#!/usr/bin/env python
"""NVFP4 figures on the default model (SmolLM2-135M-Instruct GGUF): weight memory and bytes per parameter, and
perplexity on a fixed held-out English text (tests/data/english.txt) for fp32, W4A16, W4A4, the mixed policy and,
on CPUs with AVX512-VNNI, int8 activations (W4A8; the GGUF's own layers, then NVFP4);
on CUDA also the Triton W4A16 kernel against a bf16 matmul of the same shape.

    .venv/bin/python bench/bench_nvfp4.py [--threads 2] [--budget 150MB] [--keep fp8] [--kernel-only]

W4A16 and W4A4 serve the same checkpoint (quantised with --act-quant, so it carries calibrated
input_global_scale), W4A4 with activation quantisation switched on. Perplexity is computed in fp32 on every device
so that only the weight (and activation) format differs. Prints tables and one JSON line. Figures, not
assertions: the machine is shared and noisy.

Napkin math for the kernel (decode, M small, memory-bound): per weight element NVFP4 moves 0.5 B of codes +
1/16 B of fp8 scale = 0.5625 B against bf16's 2 B, so a GEMV can be up to ~3.6x faster at the same bandwidth.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

TEXT = ROOT / "tests" / "data" / "english.txt"
# M, N, K: a large layer at decode / small batch / prefill, Llama-70B's MLP at decode; SmolLM2's gate_up, down
SHAPES = [(1, 8192, 8192), (4, 8192, 8192), (16, 8192, 8192), (128, 8192, 8192), (2048, 8192, 8192),
          (1, 57344, 8192), (1, 8192, 28672), (1, 3072, 576), (16, 576, 1536)]
PEAK = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}   # HBM B/s, bf16 FLOP/s


def perplexity(path: str, ids: list[int], act_quant: bool = False, int8: bool = False) -> float:
    """int8: the quantised layers on int8 activations for every row (qgemm_i8's wide-row path, which serving
    takes for prefill chunks of 128 rows or more, switched off), the decode path's error on every position."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    from shared.ops import qgemm_i8
    from shared.quant.model_quant import set_act_quant

    qgemm_i8.WIDE_ROWS = 1 << 30 if int8 else 128
    engine = LLMEngine(EngineConfig(model=path, progress=False, dtype="float32", num_kv_blocks=len(ids) // 16 + 2,
                                    int8_activations=int8))
    if act_quant and not set_act_quant(engine.runner.model, True):
        raise ValueError(f"{path} has no NVFP4 layers to quantise activations for")
    logits = engine.score(ids)                                             # [T, V]
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device)).item())


def model_figures(args: argparse.Namespace) -> dict:
    from shared.convert.quantize import quantize
    from shared.model_files import default_model_path
    from shared.tokenizer import Tokenizer

    src = default_model_path()
    ids = Tokenizer(src).encode(TEXT.read_text())
    work = Path(tempfile.mkdtemp(prefix="bench-nvfp4-"))
    t0 = time.perf_counter()
    plain = quantize(src, str(work / "nvfp4"), act_quant=True, progress=False)
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    mixed = quantize(src, str(work / "mixed"), policy="auto", memory_budget=args.budget, keep=args.keep,
                     progress=False)
    t_mixed = time.perf_counter() - t0
    params = plain.num_params
    rows = {"fp32": 4 * params, "bf16": 2 * params, "NVFP4 (linears; embeddings bf16)": plain.weight_bytes,
            f"mixed (auto, {args.keep} within {args.budget})": mixed.weight_bytes}
    print(f"\nweight memory, {params / 1e6:.1f} M parameters")
    print(f"{'format':<40} {'MB':>8} {'bytes/param':>12}")
    for name, b in rows.items():
        print(f"{name:<40} {b / 1e6:>8.1f} {b / params:>12.3f}")
    linear = {p: sum(1 for v in mixed.unit_precisions.values() if v == p) for p in ("nvfp4", "fp8", "bf16")}
    print(f"mixed policy: {linear} linear units; quantize took {t_plain:.1f} s (plain + W4A4 scales), "
          f"{t_mixed:.1f} s (auto) on {torch.get_num_threads()} threads")

    ppl = {"fp32": perplexity(src, ids), "W4A16": perplexity(plain.out, ids),
           "W4A4": perplexity(plain.out, ids, act_quant=True), "mixed": perplexity(mixed.out, ids)}
    from shared.ops import qgemm_i8
    if qgemm_i8.available():                  # int8 activations (--int8-activations): the file's types, NVFP4
        ppl["Q4_1 GGUF, int8 activations"] = perplexity(src, ids, int8=True)
        ppl["W4A8"] = perplexity(plain.out, ids, int8=True)
    print(f"\nperplexity on {TEXT.relative_to(ROOT)} ({len(ids)} tokens)")
    for name, p in ppl.items():
        print(f"{name:<28} {p:>8.3f} {100 * (p / ppl['fp32'] - 1):>+7.1f}%")
    return {"params": params, "bytes": rows, "perplexity": ppl, "quantize_s": {"plain": t_plain, "auto": t_mixed}}


def kernel_figures() -> list[dict]:
    """Triton W4A16 (nvfp4_matmul's default path) vs a torch bf16 matmul: kernel time (CUDA-graph replays) and the
    time of a call launched from Python (eager), weights rotated past the L2 cache (bench/cuda_timing.py)."""
    from bench.cuda_timing import eager_us, graph_us, rotation
    from shared.quant.nvfp4 import quantise_weight
    from shared.quant.nvfp4_triton import nvfp4_matmul

    name = torch.cuda.get_device_name()
    bw, flops = next((v for k, v in PEAK.items() if k in name), (None, None))
    print(f"\nTriton NVFP4 W4A16 vs bf16 matmul on {name}" + (f" (peak {bw / 1e12:.1f} TB/s, "
                                                              f"{flops / 1e12:.0f} TFLOP/s bf16)" if bw else ""))
    print(f"{'M x N x K':>20} {'nvfp4 us':>9} {'bf16 us':>9} {'speed-up':>9} {'nvfp4 GB/s':>11} {'bf16 GB/s':>10} "
          f"{'eager nvfp4 us':>15} {'eager bf16 us':>14}")
    out = []
    for m, n, k in SHAPES:
        ws = [torch.randn(n, k, device="cuda") for _ in range(rotation(n * k * 9 // 16))]
        qs, bs = [quantise_weight(w) for w in ws], [w.bfloat16() for w in ws]
        del ws
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        calls_q = [lambda q=q: nvfp4_matmul(x, q) for q in qs]
        calls_b = [lambda b=b: x @ b.T for b in bs]
        t_q, t_b = graph_us(calls_q) * 1e-6, graph_us(calls_b) * 1e-6
        e_q, e_b = eager_us(calls_q), eager_us(calls_b)
        moved_q = n * k * 0.5625 + 2 * m * (k + n)                         # weights + activations in and out
        moved_b = n * k * 2 + 2 * m * (k + n)
        r = {"m": m, "n": n, "k": k, "nvfp4_us": t_q * 1e6, "bf16_us": t_b * 1e6, "nvfp4_GBps": moved_q / t_q / 1e9,
             "bf16_GBps": moved_b / t_b / 1e9, "nvfp4_TFLOPs": 2 * m * n * k / t_q / 1e12, "eager_nvfp4_us": e_q,
             "eager_bf16_us": e_b}
        out.append(r)
        print(f"{f'{m}x{n}x{k}':>20} {r['nvfp4_us']:>9.1f} {r['bf16_us']:>9.1f} {t_b / t_q:>8.2f}x "
              f"{r['nvfp4_GBps']:>11.0f} {r['bf16_GBps']:>10.0f} {e_q:>15.1f} {e_b:>14.1f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--budget", default="150MB", help="memory budget of the mixed (auto) policy")
    p.add_argument("--keep", default="fp8", choices=["fp8", "bf16"], help="precision of the mixed policy's kept layers")
    p.add_argument("--kernel-only", action="store_true", help="only the CUDA kernel figures")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {}
    if not args.kernel_only:
        result["model"] = model_figures(args)
    if torch.cuda.is_available():
        result["kernel"] = kernel_figures()
    else:
        print("\n(no CUDA device: Triton kernel figures skipped)")
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
