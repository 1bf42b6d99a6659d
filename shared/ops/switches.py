"""The C kernels' off switches, one option (`--disable-kernels`) for all of them.

Each kernel of shared/ops runs where it builds, where the CPU has its instructions and where its start-up check
agrees with its torch reference; turning one off makes the code that would call it take its other path (torch, or
the next kernel down). Each kernel reads its `UPESI_<NAME>` variable at first use, so `disable` sets those variables
in this process before any kernel loads, and the processes it starts inherit them.
"""
from __future__ import annotations

import os

from shared.config import env_name               # UPESI_<NAME>, as every option's variable

# name -> what turning it off leaves
KERNELS: dict[str, str] = {
    "rows_gemm": "bf16 / fp32 linear layers in prepacked panels (oneDNN or MKL instead)",
    "amx": "AMX tiles for linear, quantised and prefill-attention kernels (their AVX512-BF16 paths instead)",
    "qgemm": "quantised GGUF / NVFP4 layers read as packed codes (dequantised at load instead)",
    "qgemm_i8": "the int8-activation kernel (--int8-activations is then refused)",
    "cpu_decoder": "the decoder stack in one C call (module by module instead)",
    "cpu_attention": "paged attention, RoPE and the KV store for decode and verification rows (torch instead)",
    "attention_avx512": "attention's AVX-512 path (its AVX2 path instead)",
    "prefill_attention": "flash-style attention kernel for long prefill chunks (torch's SDPA instead)",
    "cpu_norm": "RMSNorm (torch instead)",
    "cpu_argmax": "the greedy argmax over the logits (torch instead)",
}


def parse(names: str | None) -> list[str]:
    """A comma-separated list of kernel names -> the names; ValueError naming the known ones for any other."""
    out = [n.strip() for n in (names or "").split(",") if n.strip()]
    unknown = [n for n in out if n not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown} in --disable-kernels; known: {', '.join(KERNELS)}")
    return out


def disable(names: str | None) -> list[str]:
    """Turns the named kernels off for this process and its children (before any kernel loads); returns them."""
    out = parse(names)
    for name in out:
        os.environ[env_name(name)] = "0"
    return out
