"""NVFP4: E2M1 codes in blocks of 16 with an FP8 E4M3 scale per block and one FP32 scale per tensor.

Shapes: N = out features, K = in features (a multiple of 16), B = K // 16 blocks, M = rows of an activation.

Compressed-tensors convention (checked bit for bit against compressed-tensors 0.20.1):

    global_scale = 448 * 6 / amax(|x|)            # fp32; 1.0 when that is not finite (x all zero)
    scale[b]     = fp8(amax(|x[b]|) / 6 * global_scale)   # clamped to 448; a scale that rounds to 0 -> 0.125
    code         = e2m1(x / (scale / global_scale))       # nearest, ties to even, saturating at +-6
    x_hat        = value(code) * (scale / global_scale)

E2M1 code (4 bits): sign << 3 | magnitude index, magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6]. A negative value that
rounds to zero keeps its sign (code 0b1000); an input of -0.0 gives code 0, as compressed-tensors does.
Two codes per byte: the even element in the low nibble.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
FP8_ZERO_SCALE = 0.125  # compressed-tensors replaces a block scale of 0 by the fp8 "eps" so x / scale stays finite
SCALE_DTYPE = torch.float8_e4m3fn
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding boundaries between consecutive magnitudes; at a tie the even index (mantissa bit 0) wins, so a tie
# rounds down where the lower index is even and up where the upper one is.
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)   # lower neighbour 0, 1.0, 2.0, 4.0 has an even index
_TIE_UP = (0.75, 1.75, 3.5)          # upper neighbour 1.0, 2.0, 4.0 has an even index


class NVFP4Error(ValueError):
    """Base class of every NVFP4 format error; a ValueError so callers can map it to INVALID_ARGUMENT."""


class NonFiniteInputError(NVFP4Error):
    """The tensor to quantise holds inf or NaN, which NVFP4 cannot represent."""


class NVFP4ShapeError(NVFP4Error):
    """A tensor does not have the shape or dtype the format needs (K a multiple of 16, uint8 codes, fp8 scales)."""


@dataclass(slots=True)
class NVFP4Weight:
    """One NVFP4 linear weight as stored in a checkpoint (compressed-tensors convention).

    packed:             [N, K/2] uint8, two E2M1 codes a byte, the even element in the low nibble
    scale:              [N, B] float8_e4m3fn, one per block of 16 along K
    global_scale:       [1] float32, the divisor: x_hat = value(code) * scale / global_scale
    input_global_scale: [1] float32 or None, the activations' static global scale for W4A4
    """
    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    input_global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8 or self.packed.ndim != 2:
            raise NVFP4ShapeError(f"packed must be a 2-D uint8 tensor, got {self.packed.dtype} "
                                  f"{tuple(self.packed.shape)}")
        n, half_k = self.packed.shape
        if self.scale.dtype != SCALE_DTYPE or tuple(self.scale.shape) != (n, 2 * half_k // BLOCK_SIZE) \
                or (2 * half_k) % BLOCK_SIZE:
            raise NVFP4ShapeError(f"scale must be float8_e4m3fn [{n}, K/16] for packed {tuple(self.packed.shape)}, "
                                  f"got {self.scale.dtype} {tuple(self.scale.shape)}")
        s = self.scale.float()
        if not (torch.isfinite(s) & (s >= 0)).all():
            raise NVFP4Error("block scales must be finite and non-negative")
        self.global_scale = _as_global_scale(self.global_scale, "global_scale")
        if self.input_global_scale is not None:
            self.input_global_scale = _as_global_scale(self.input_global_scale, "input_global_scale")

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] that the codes and scales stand for."""
        return dequantise(self.packed, self.scale, self.global_scale, dtype)


def _as_global_scale(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.numel() != 1:
        raise NVFP4ShapeError(f"{name} must hold one value, got shape {tuple(t.shape)}")
    t = t.detach().to(torch.float32).reshape(1)
    if not (torch.isfinite(t).all() and (t > 0).all()):
        raise NVFP4Error(f"{name} must be finite and positive, got {t.item()}")
    return t


def check_finite(x: torch.Tensor) -> None:
    """Raise NonFiniteInputError if x holds inf or NaN (one host sync)."""
    if not torch.isfinite(x).all():
        n_nan, n_inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        raise NonFiniteInputError(f"cannot quantise to NVFP4: tensor {tuple(x.shape)} has {n_nan} NaN and {n_inf} "
                                  "inf values")


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.ndim == 0 or x.shape[-1] % BLOCK_SIZE:
        raise NVFP4ShapeError(f"the last dim must be a multiple of {BLOCK_SIZE}, got shape {tuple(x.shape)}")
    return x.unflatten(-1, (x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))  # [..., B, 16]


def global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """[1] fp32: 448 * 6 / amax, so the largest block scale lands on the top of the fp8 range.

    As in compressed-tensors' generate_gparam: amax is clamped to the smallest normal fp32 and a result that is
    not finite (amax 0 or denormal) becomes 1.0, a harmless scale for an all-zero tensor.
    """
    amax = torch.as_tensor(amax, dtype=torch.float32).abs().reshape(1)
    gs = FP8_MAX * FP4_MAX / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)


def block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """[..., B] float8_e4m3fn scales of x [..., K]; fp8 rounding is nearest-even, subnormals kept."""
    amax = _blocks(x.float()).abs().amax(dim=-1)                          # [..., B]
    s = (amax / FP4_MAX) * global_scale.float()                           # same op order as compressed-tensors
    s = s.clamp(max=FP8_MAX).to(SCALE_DTYPE).float()
    return torch.where(s == 0, FP8_ZERO_SCALE, s).to(SCALE_DTYPE)


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes (low 4 bits) of the scaled values q: nearest E2M1, ties to even, saturating at +-6."""
    a = q.abs()
    idx = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for t in _TIE_DOWN:
        idx += a > t
    for t in _TIE_UP:
        idx += a >= t
    return idx | ((q < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float values of uint8 codes (low 4 bits)."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=codes.device)
    return lut[(codes & 0xF).long()]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes -> [..., K/2] bytes, the even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise NVFP4ShapeError(f"cannot pack an odd last dim {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] uint8 codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantise(x: torch.Tensor, global_scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (packed [..., K/2] uint8, scale [..., B] fp8, global_scale [1] fp32).

    The global scale comes from x's amax unless one is given (a static activation scale, say).
    Raises NonFiniteInputError on inf or NaN and NVFP4ShapeError when K is not a multiple of 16.
    """
    xf = x.float()
    check_finite(xf)
    xb = _blocks(xf)                                                       # [..., B, 16]
    if global_scale is None:
        gs = global_scale_from_amax(xf.abs().amax())                       # [1]
    else:
        gs = _as_global_scale(global_scale, "global_scale").to(xf.device)
    scale = block_scales(xf, gs)                                           # [..., B] fp8
    step = scale.float() / gs                                              # [..., B] dequant step of each block
    codes = e2m1_encode(xb / step.unsqueeze(-1)).flatten(-2)               # [..., K]
    return pack(codes), scale, gs


def dequantise(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [..., K/2], scale [..., B] -> [..., K] in dtype; computed in fp32 as value * (scale / global_scale)."""
    values = _blocks(e2m1_decode(unpack(packed)))                          # [..., B, 16]
    step = scale.float() / global_scale.to(scale.device, torch.float32).reshape(1)  # [..., B]
    return (values * step.unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quantise(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """dequantise(quantise(x)) in x's dtype: what a W4A4 kernel sees of the activations."""
    packed, scale, gs = quantise(x, global_scale)
    return dequantise(packed, scale, gs, x.dtype)


def quantise_weight(weight: torch.Tensor, input_global_scale: torch.Tensor | None = None) -> NVFP4Weight:
    """A float [N, K] weight as an NVFP4Weight with its own per-tensor global scale."""
    if weight.ndim != 2:
        raise NVFP4ShapeError(f"a linear weight is 2-D [N, K], got shape {tuple(weight.shape)}")
    packed, scale, gs = quantise(weight)
    return NVFP4Weight(packed, scale, gs, input_global_scale)
