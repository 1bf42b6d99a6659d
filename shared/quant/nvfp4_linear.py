"""NVFP4 linear layers in plain torch: the reference every NVFP4 kernel is checked against.

Shapes: M = rows of x (tokens), K = in features, N = out features.

W4A16: y = x @ dequant(W)^T.
W4A4 (emulated): the activations are also quantised to NVFP4, per block of 16 along K with their own fp8 block
scales, and a global scale that is the checkpoint's input_global_scale when there is one, else 448*6/amax(x)
computed on the fly. The product then runs in fp32 on the two dequantised operands, which is what a
Blackwell FP4 tensor core computes up to the order of accumulation.
"""
from __future__ import annotations

import torch

from shared.quant.nvfp4 import NVFP4ShapeError, NVFP4Weight, fake_quantise


def nvfp4_linear(x: torch.Tensor, w: NVFP4Weight, act_quant: bool = False,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, accumulating in fp32.

    act_quant=False is W4A16; act_quant=True emulates W4A4. Raises NVFP4ShapeError when K does not match the
    weight and NonFiniteInputError when act_quant meets inf or NaN activations.
    """
    if x.shape[-1] != w.in_features:
        raise NVFP4ShapeError(f"x has {x.shape[-1]} features, the weight expects {w.in_features}")
    xf = x.float()                                                         # [..., K]
    if act_quant:
        xf = fake_quantise(xf, w.input_global_scale)                       # [..., K] on the NVFP4 grid
    y = xf @ w.dequantise(torch.float32).T                                 # [..., N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
