"""Quantised linear layers that hold their checkpoint's packed tensors: NVFP4 (W4A16 / emulated W4A4) and FP8.

Shapes: M = rows of x (tokens), K = in features, N = out features (all segments), B = K // 16,
S = segments (q/k/v of a fused qkv_proj: 3, gate/up: 2, an unfused layer: 1).

A fused layer concatenates its checkpoint layers along N. NVFP4 blocks run along K, so the packed codes and the
fp8 block scales of q, k and v concatenate row-wise exactly; only the per-tensor global scales differ, so they are
kept per segment ([S] fp32) and each segment runs as its own NVFP4Weight:

    rows  0 .. q-1        | packed [q, K/2]  scale [q, B]  weight_global_scale[0]
    rows  q .. q+kv-1     | packed [kv, K/2] scale [kv, B] weight_global_scale[1]
    rows  q+kv .. N-1     | packed [kv, K/2] scale [kv, B] weight_global_scale[2]

The storage dtypes (uint8 codes, fp8 scales, fp32 global scales) are the format: `model.to(dtype=...)` moves these
buffers between devices but never converts them (see _apply); a bias follows the model's dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shared.ops import qgemm, qgemm_i8
from shared.ops.block_quant import BlockQuant
from shared.ops.qgemm import QWeight
from shared.ops.qgemm_i8 import QWeightI8
from shared.quant.nvfp4 import BLOCK_SIZE, SCALE_DTYPE, NVFP4ShapeError, NVFP4Weight, e2m1_decode, fake_quantise

FP8_DTYPE = torch.float8_e4m3fn


class _PackedLinear(nn.Module):
    """Common part: segment bookkeeping, an optional bias, and buffers whose dtype survives `.to(dtype)`."""

    def __init__(self, in_features: int, segments: Sequence[int], bias: bool, device: torch.device | str | None):
        super().__init__()
        self.in_features = in_features
        self.segments = tuple(segments)
        self.out_features = sum(self.segments)
        self.offsets = [0]
        for n in self.segments:
            self.offsets.append(self.offsets[-1] + n)
        self.bias = nn.Parameter(torch.empty(self.out_features, device=device)) if bias else None

    def _apply(self, fn, recurse: bool = True):
        old = {name: b for name, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for name, b in old.items():
            new = self._buffers[name]
            if new is not None and new.dtype != b.dtype:   # a dtype cast: keep the format, follow the device only
                self._buffers[name] = b.to(new.device)
        self._cache, self._shared_input_scale = None, None
        if hasattr(self, "_packed"):
            self._packed = None
        return self

    def rows(self, index: int) -> slice:
        return slice(self.offsets[index], self.offsets[index + 1])

    def _check(self, index: int, n: int, k: int, name: str) -> None:
        if not 0 <= index < len(self.segments):
            raise NVFP4ShapeError(f"{name}: segment {index} out of range (layer has {len(self.segments)})")
        if (n, k) != (self.segments[index], self.in_features):
            raise NVFP4ShapeError(f"{name}: checkpoint weight [{n}, {k}] != model segment "
                                  f"[{self.segments[index]}, {self.in_features}]")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, segments={list(self.segments)}, bias={self.bias is not None}"


class NVFP4Linear(_PackedLinear):
    """y = x @ dequant(W)^T (+ bias): W4A16, or emulated W4A4 when act_quant is set.

    Buffers (the compressed-tensors tensors, fused layers concatenated along N):
        weight_packed       [N, K/2] uint8
        weight_scale        [N, B]   float8_e4m3fn
        weight_global_scale [S]      float32, one per segment
        input_global_scale  [S]      float32, one per segment (W4A4 checkpoints only, else None)
    With act_quant and no input_global_scale the activations' global scale is computed per call (dynamic).
    On CUDA, W4A16 runs the Triton kernel (shared.quant.nvfp4_triton), one launch per segment; on CPUs where
    shared.ops.qgemm runs, its C kernel on the codes (`packed`: the same codes and scales laid out once for it, so
    the decoder stack takes the layer too); elsewhere, and for W4A4, the arithmetic of the torch reference
    shared.quant.nvfp4_linear on the whole fused weight, dequantised per call (tests check each against the
    reference). Nothing dense is kept between calls.
    """

    def __init__(self, in_features: int, segments: Sequence[int], bias: bool = False, act_quant: bool = False,
                 input_scales: bool = False, device: torch.device | str | None = None) -> None:
        super().__init__(in_features, segments, bias, device)
        if in_features % BLOCK_SIZE:
            raise NVFP4ShapeError(f"NVFP4 needs in_features to be a multiple of {BLOCK_SIZE}, got {in_features}")
        n, s = self.out_features, len(self.segments)
        self.act_quant = act_quant
        self.register_buffer("weight_packed", torch.zeros(n, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(n, in_features // BLOCK_SIZE, dtype=SCALE_DTYPE,
                                                         device=device))
        self.register_buffer("weight_global_scale", torch.ones(s, dtype=torch.float32, device=device))
        self.register_buffer("input_global_scale",
                             torch.ones(s, dtype=torch.float32, device=device) if input_scales else None)
        self._cache: list[NVFP4Weight] | None = None
        self._shared_input_scale: bool | None = None
        self._packed: QWeight | QWeightI8 | None = None
        self.int8_activations = False      # opt-in W4A8: shared.ops.qgemm_i8 where it runs

    @property
    def packed(self) -> QWeight | QWeightI8 | None:
        """The codes laid out for shared.ops.qgemm, or for shared.ops.qgemm_i8 with int8_activations (built at
        first use), or None where neither kernel serves this layer (W4A4, another device, no kernel on this CPU)."""
        if self.act_quant or self.weight_packed.device.type != "cpu":
            return None
        if self._packed is None and self.int8_activations and qgemm_i8.available():
            bq, gs = self._fp8_blocks()                       # fp8 scales (exact in fp16), 1 / global per column
            self._packed = QWeightI8(bq, 1.0 / gs)
        elif self._packed is None and qgemm.available():
            self._packed = QWeight(self.block_quant())
        return self._packed

    def block_quant(self) -> BlockQuant:
        """The weight as codes, the fp8 block scales and 1 / global_scale per column: value(code) * scale is exact
        in bf16, so the kernels may multiply it as bf16 weights, and the global factor applies to each column's sum
        (the reference nvfp4.dequantise rounds value * (scale / global_scale); the two differ by fp32 rounding)."""
        bq, gs = self._fp8_blocks()
        bq.col_scale = 1.0 / gs
        return bq

    def _fp8_blocks(self) -> tuple[BlockQuant, torch.Tensor]:
        """(the codes with the fp8 block scales as their steps, each row's global scale [N])."""
        n, k = self.out_features, self.in_features
        codes = torch.stack((self.weight_packed & 0xF, self.weight_packed >> 4), dim=-1).view(n, k)
        gs = torch.cat([self.weight_global_scale[i].expand(r) for i, r in enumerate(self.segments)])     # [N]
        lut = e2m1_decode(torch.arange(16, dtype=torch.uint8))
        return BlockQuant(codes.contiguous(), self.weight_scale.float(), None, BLOCK_SIZE, 4, lut), gs

    @torch.no_grad()
    def load_segment(self, index: int, w: NVFP4Weight, name: str = "") -> None:
        """Copies one checkpoint layer (q_proj of a fused qkv_proj, say) into its rows."""
        self._check(index, w.out_features, w.in_features, name)
        if (w.input_global_scale is None) != (self.input_global_scale is None):
            state = "missing" if w.input_global_scale is None else "unexpected"
            raise NVFP4ShapeError(f"{name}: input_global_scale is {state} (the config's input_activations disagree)")
        r = self.rows(index)
        self.weight_packed[r].copy_(w.packed)
        self.weight_scale[r].copy_(w.scale)
        self.weight_global_scale[index].copy_(w.global_scale[0])
        if w.input_global_scale is not None:
            self.input_global_scale[index].copy_(w.input_global_scale[0])
        self._cache, self._shared_input_scale, self._packed = None, None, None

    def segment(self, index: int) -> NVFP4Weight:
        """The NVFP4Weight of one segment: views of the packed rows, so nothing is copied."""
        r = self.rows(index)
        igs = None if self.input_global_scale is None else self.input_global_scale[index:index + 1]
        return NVFP4Weight(self.weight_packed[r], self.weight_scale[r],
                           self.weight_global_scale[index:index + 1], igs)

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [N, K], equal bit for bit to each segment's nvfp4.dequantise: the same fp32
        value * (scale / global_scale), with codes decoded a byte (two codes) at a time, ~15x faster."""
        n, k = self.out_features, self.in_features
        values = F.embedding(self.weight_packed.int(), _byte_values(self.weight_packed.device))   # [N, K/2, 2]
        gs = torch.cat([self.weight_global_scale[i].expand(r) for i, r in enumerate(self.segments)])  # [N]
        step = self.weight_scale.float() / gs[:, None]                                           # [N, B]
        return (values.view(n, k // BLOCK_SIZE, BLOCK_SIZE) * step.unsqueeze(-1)).view(n, k).to(dtype)

    def _one_input_scale(self) -> bool:
        if self._shared_input_scale is None:   # one host sync after loading, not one per step
            igs = self.input_global_scale
            self._shared_input_scale = bool((igs == igs[0]).all())
        return self._shared_input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype; the arithmetic of shared.quant.nvfp4_linear (fp32 accumulation)."""
        if x.is_cuda and not self.act_quant:
            return self.forward_triton(x)
        packed = self.packed if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) else None
        if packed is not None and not (torch.is_grad_enabled() and x.requires_grad):
            if isinstance(packed, QWeightI8):
                return qgemm_i8.linear(x, packed, self.bias)
            return qgemm.linear(x, packed, self.bias)
        xf = x.float()                                                      # [..., K]
        w = self.dequantise(torch.float32)                                  # [N, K]
        igs = self.input_global_scale
        if not self.act_quant:
            y = xf @ w.T                                                    # [..., N]
        elif igs is None or self._one_input_scale():                         # one activation scale for all rows
            y = fake_quantise(xf, None if igs is None else igs[:1]) @ w.T
        else:                                                               # q/k/v calibrated apart
            y = torch.cat([fake_quantise(xf, igs[i:i + 1]) @ w[self.rows(i)].T
                           for i in range(len(self.segments))], dim=-1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """W4A16 through the Triton kernel, one launch per segment (CUDA, or CPU under TRITON_INTERPRET=1)."""
        if self._cache is None:          # validated once (one host sync per segment), not per step
            self._cache = [self.segment(i) for i in range(len(self.segments))]
        from shared.quant.nvfp4_triton import nvfp4_matmul  # lazy: triton only where it runs
        ys = [nvfp4_matmul(x, w) for w in self._cache]                      # S x [..., N_s]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)                # [..., N]
        return y if self.bias is None else y + self.bias


_BYTE_VALUES: dict[torch.device, torch.Tensor] = {}


def _byte_values(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two E2M1 values a packed byte holds, low nibble (even element) first."""
    if device not in _BYTE_VALUES:
        codes = torch.arange(256, dtype=torch.uint8)
        _BYTE_VALUES[device] = e2m1_decode(torch.stack((codes & 0xF, codes >> 4), dim=-1)).to(device)
    return _BYTE_VALUES[device]


class FP8Linear(_PackedLinear):
    """y = x @ (fp32(W) * weight_scale)^T (+ bias): FP8 E4M3 weights with one fp32 scale per output row, the
    compressed-tensors "float-quantized" channel layout (weight [N, K] fp8, weight_scale [N, 1]).
    Per-row scales make fused layers a plain row concatenation."""

    def __init__(self, in_features: int, segments: Sequence[int], bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__(in_features, segments, bias, device)
        self.register_buffer("weight", torch.zeros(self.out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(self.out_features, 1, dtype=torch.float32, device=device))
        self._cache = None

    @torch.no_grad()
    def load_segment(self, index: int, weight: torch.Tensor, scale: torch.Tensor, name: str = "") -> None:
        self._check(index, *weight.shape, name)
        if weight.dtype != FP8_DTYPE or scale.numel() != weight.shape[0]:
            raise NVFP4ShapeError(f"{name}: expected an fp8 e4m3 weight and one scale per row, got {weight.dtype} "
                                  f"and {tuple(scale.shape)}")
        self.weight[self.rows(index)].copy_(weight)
        self.weight_scale[self.rows(index)].copy_(scale.reshape(-1, 1).float())

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale).to(dtype)         # [N, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() @ self.dequantise(torch.float32).T                    # [..., N], fp32 accumulation
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


def fp8_quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 e4m3 [N, K], fp32 scale [N, 1]) with scale = amax(|row|) / 448 (1 for an all-zero row)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True)                               # [N, 1]
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (wf / scale).clamp(-448.0, 448.0).to(FP8_DTYPE), scale
