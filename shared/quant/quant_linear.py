"""A linear layer whose weight stays block-quantised (shared.ops.qgemm): GGUF's quant types as the file has them.

Fused layers (q/k/v, gate/up) concatenate their checkpoint layers' rows; each segment arrives as a BlockQuant
(`load_segment`) and the layer packs once every segment is in (`finish`). A PackedLinear (shared.ops.packed_linear)
by type, so the code that frees a layer moved to expert shards, and the byte counts, treat it as one.
Shapes: M = rows, K = in features, N = out features (all segments).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shared.ops import qgemm, qgemm_i8
from shared.ops.packed_linear import PackedLinear
from shared.ops.block_quant import BlockQuant
from shared.ops.qgemm import QWeight
from shared.ops.qgemm_i8 import QWeightI8


class QuantLinear(PackedLinear):
    """y = x @ W^T (+ bias), W [N, K] held as a QWeight (`packed`)."""

    def __init__(self, in_features: int, segments: Sequence[int], bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.segments = in_features, tuple(segments)
        self.out_features = sum(self.segments)
        self.bias = nn.Parameter(torch.empty(self.out_features, device=device)) if bias else None
        self.keep_weight = False
        self.packed: QWeight | QWeightI8 | None = None
        self.int8_activations = False      # opt-in W4A8 / W8A8: shared.ops.qgemm_i8 where it runs
        self.packed_nbytes = 0
        self._parts: dict[int, BlockQuant] = {}

    def load_segment(self, index: int, bq: BlockQuant, name: str = "") -> None:
        """One checkpoint layer's codes and scales, rows of segment `index`; packs the layer once all are in."""
        if not 0 <= index < len(self.segments) or bq.shape != (self.segments[index], self.in_features):
            raise ValueError(f"{name}: a [{bq.shape[0]}, {bq.shape[1]}] weight does not fit segment {index} of "
                             f"{list(self.segments)} x {self.in_features}")
        self._parts[index] = bq
        if len(self._parts) == len(self.segments):
            self.finish()

    def finish(self) -> None:
        if len(self._parts) != len(self.segments):
            raise ValueError(f"a quantised layer got {len(self._parts)} of its {len(self.segments)} segments")
        bq = BlockQuant.cat([self._parts[i] for i in range(len(self.segments))])
        i8 = qgemm_i8.pack(bq) if self.int8_activations else None      # None: the exact kernel takes it
        self.packed = i8 if i8 is not None else QWeight(bq)
        self.packed_nbytes = self.packed.nbytes
        self._parts = {}

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight [N, K] fp32, a copy (for the rare reader: autograd, a draft head's rows)."""
        return self.packed.dequantise()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError("this QuantLinear holds no weight (not loaded, or released to expert shards)")
        if x.device.type != "cpu" or not qgemm.available():
            return F.linear(x, self.packed.dequantise().to(device=x.device, dtype=x.dtype), self.bias)
        if isinstance(self.packed, QWeightI8):
            return qgemm_i8.linear(x, self.packed, self.bias)
        return qgemm.linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        kind = "-" if self.packed is None else f"kind {self.packed.kind}, block {self.packed.block}"
        return f"in_features={self.in_features}, segments={list(self.segments)}, {kind}"
