#!/usr/bin/env python
"""NVFP4 against bf16 weights through the engine on a CUDA GPU: decode tokens/s of a random Llama with wide layers
(Llama-70B's by default, a few of them, so that reading weights rather than Python dominates a step).

    python bench/bench_gpu_decode.py [--hidden 8192] [--intermediate 28672] [--layers 3] [--batch 1 8]

The bf16 checkpoint is written to a temporary folder and served by LLMEngine (paged KV cache, Triton attention);
then every linear layer is replaced in place by an NVFP4Linear holding its quantised weight (the LM head, tied to
the embeddings, stays bf16), and the same prompts decode again, through the tiled kernel and then with the GEMV
kernel taking every product of up to 16 rows. Greedy, ignore_eos; figures, not assertions.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.engine.config import EngineConfig  # noqa: E402
from shared.engine.engine import LLMEngine  # noqa: E402
from shared.quant.model_quant import linear_units  # noqa: E402
from shared.quant.nvfp4 import quantise_weight  # noqa: E402
from shared.quant import nvfp4_triton  # noqa: E402
from shared.quant.nvfp4_module import NVFP4Linear  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402


def write_checkpoint(path: Path, a: argparse.Namespace, device: str = "cuda") -> None:
    """A random bf16 Llama (std 0.02 weights, unit norms) as a Hugging Face folder."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    head_dim = a.hidden // a.heads
    LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=a.vocab - 1,
                bos_token_id=0).save_pretrained(path)
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=g) * 0.02).bfloat16().cpu()

    t = {"model.embed_tokens.weight": rnd(a.vocab, a.hidden), "model.norm.weight": torch.ones(a.hidden).bfloat16()}
    for i in range(a.layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": rnd(a.hidden, a.hidden),
              p + "self_attn.k_proj.weight": rnd(a.kv_heads * head_dim, a.hidden),
              p + "self_attn.v_proj.weight": rnd(a.kv_heads * head_dim, a.hidden),
              p + "self_attn.o_proj.weight": rnd(a.hidden, a.hidden),
              p + "mlp.gate_proj.weight": rnd(a.intermediate, a.hidden),
              p + "mlp.up_proj.weight": rnd(a.intermediate, a.hidden),
              p + "mlp.down_proj.weight": rnd(a.hidden, a.intermediate),
              p + "input_layernorm.weight": torch.ones(a.hidden).bfloat16(),
              p + "post_attention_layernorm.weight": torch.ones(a.hidden).bfloat16()}
    save_file(t, str(path / "model.safetensors"))


@torch.no_grad()
def to_nvfp4(model: torch.nn.Module) -> int:
    """Replaces every linear unit by its NVFP4 quantisation (W4A16); returns how many."""
    units = linear_units(model)
    for unit in units:
        dense = model.get_submodule(unit.name)
        q = NVFP4Linear(unit.in_features, unit.segments, unit.bias, device=dense.weight.device)
        row = 0
        for i, (rows, name) in enumerate(zip(unit.segments, unit.hf_names)):
            q.load_segment(i, quantise_weight(dense.weight[row:row + rows].float()), name)
            row += rows
        parent, _, short = unit.name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, short, q)
    torch.cuda.empty_cache()
    return len(units)


def decode(eng: LLMEngine, batch: int, tokens: int) -> tuple[float, list[int]]:
    """Tokens/s of `batch` sequences decoding `tokens` each after a 16-token prompt, and the first's tokens."""
    prompts = [[1 + (7 * b + j) % 1000 for j in range(16)] for b in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # compile, warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = eng.generate(prompts, params)
    torch.cuda.synchronize()
    return batch * tokens / (time.perf_counter() - t0), out[0][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--intermediate", type=int, default=28672)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens a sequence")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="sequences decoding together")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        write_checkpoint(Path(d), a)
        eng = LLMEngine(EngineConfig(model=d, progress=False, num_kv_blocks=512, block_size=16, device="cuda",
                                     dtype="bfloat16"))
        print(f"{torch.cuda.get_device_name()}: {a.layers} layers, hidden {a.hidden}, intermediate "
              f"{a.intermediate}; checkpoint written and loaded in {time.perf_counter() - t0:.0f} s", flush=True)
        rows = {}
        for name in ("bf16", "nvfp4", "nvfp4-gemv"):
            if name == "nvfp4":
                n = to_nvfp4(eng.runner.model)
                print(f"{n} linear units quantised", flush=True)
            nvfp4_triton.GEMV_DEFAULT_ROWS = nvfp4_triton.GEMV_ROWS if name == "nvfp4-gemv" else 0
            mem = torch.cuda.memory_allocated() / 1e9
            for b in a.batch:
                rate, toks = decode(eng, b, a.tokens)
                rows[name, b] = rate
                print(f"{name:>6} batch {b:>3}: {rate:8.1f} tokens/s ({mem:.2f} GB allocated), first tokens "
                      f"{toks[:8]}", flush=True)
        for b in a.batch:
            print(f"batch {b}: nvfp4 / bf16 = {rows['nvfp4', b] / rows['bf16', b]:.2f}x, with the GEMV kernel "
                  f"{rows['nvfp4-gemv', b] / rows['bf16', b]:.2f}x")


if __name__ == "__main__":
    main()
