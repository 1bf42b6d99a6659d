"""GGUF's quant types read as codes and scales (shared/quant/gguf_blocks.py) against gguf's own dequantisation, bit
for bit, and through the kernel (shared/ops/qgemm.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from shared.ops import qgemm
from shared.quant.gguf_blocks import PACKED_TYPES, gguf_block_quant

# where each type keeps its fp16 fields (random bytes there could be NaN or inf)
F16_AT = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(kind: T, n: int, k: int, seed: int) -> np.ndarray:
    """[N, K / block * bytes]: random codes and scales, fp16 fields finite (some zero, some subnormal)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in F16_AT[kind]:
        d = rng.uniform(-0.1, 0.1, (n, k // block)).astype(np.float16)
        d[0, 0], d[-1, -1] = 0.0, np.float16(2.0 ** -24)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", sorted(PACKED_TYPES))
def test_every_type_equals_gguf_dequantise(kind: T) -> None:
    n, k = 24, 512
    raw = random_blocks(kind, n, k, seed=int(kind))
    want = dequantize(raw, kind).reshape(n, k)
    bq = gguf_block_quant(raw, kind, (n, k))
    assert np.array_equal(bq.dequantise().numpy(), want)
    if qgemm.available():
        w = qgemm.QWeight(bq)
        assert np.array_equal(w.dequantise().numpy(), want)        # packed for the kernel: the same weight
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
        ref = x.double() @ torch.from_numpy(want).double().t()
        got = qgemm.run(x, w).double()
        assert (got - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_quantised_real_weights_round_trip(kind: T) -> None:
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(64, 256, generator=g) * 0.05).numpy()
    raw = quantize(w, kind)
    bq = gguf_block_quant(raw, kind, (64, 256))
    assert bq.scale_f16                                             # their scales pack in 2 bytes
    assert np.array_equal(bq.dequantise().numpy(), dequantize(raw, kind).reshape(64, 256))


def test_other_types_are_refused() -> None:
    with pytest.raises(ValueError, match="not kept packed"):
        gguf_block_quant(np.zeros((2, 64), dtype=np.uint8), T.IQ4_NL, (2, 64))
