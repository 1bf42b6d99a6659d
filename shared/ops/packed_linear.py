"""Linear layers with their weights prepacked for CPU serving: bf16 for oneDNN, fp32 in panels for rows_gemm.

`F.linear` on a bf16 CPU tensor hands the [out, in] weight to oneDNN, which reorders it into its blocked layout on
every call: at the few rows of a decode or a verification step that reorder is about half the cost. Packing once
at load (as torch.compile's CPU freezing does) runs the same oneDNN kernel on the packed copy, so the result is
bit-identical to `F.linear` and about 2x faster on this project's CPUs (bench/bench_matmul_rows.py: bf16-packed).
The torch reference is `F.linear` itself (tests/unit/test_packed_linear.py).

fp32 weights go into the panels of shared.ops.rows_gemm where its AVX2 kernel runs (not bit-identical to MKL, but
each row's result independent of the rows beside it; checked against F.linear and, through the model, against
transformers); elsewhere fp32 stays on `F.linear`.
Shapes: N = rows (any leading dims), I = in features, O = out features.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shared.ops import rows_gemm, rows_gemm_bf16
from shared.ops.rows_gemm import RowsWeight
from shared.ops.rows_gemm_bf16 import RowsWeightBF16


@functools.cache
def packing_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear ops and they agree with F.linear."""
    try:
        w, x = torch.randn(8, 16).bfloat16(), torch.randn(3, 16).bfloat16()
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return torch.equal(y, F.linear(x, w))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def packable(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return rows_gemm_bf16.packable(weight) or packing_available()
    return rows_gemm.packable(weight)


Packed = torch.Tensor | RowsWeight | RowsWeightBF16


def pack_weight(weight: torch.Tensor) -> Packed:
    """[O, I] CPU -> bf16: panels for the AVX512-BF16 kernel where it runs (a RowsWeightBF16), else an opaque
    oneDNN tensor (no storage, never saved or moved); fp32: a RowsWeight."""
    if weight.dtype == torch.float32:
        return RowsWeight(weight)
    if rows_gemm_bf16.packable(weight):
        return RowsWeightBF16(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., I] @ packed [O, I]^T (+ bias) -> [..., O]."""
    if isinstance(packed, RowsWeightBF16):                   # before RowsWeight: its subclass
        return rows_gemm_bf16.rows_linear(x, packed, bias)
    if isinstance(packed, RowsWeight):
        return rows_gemm.rows_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """A linear layer for inference whose weight [O, I] lives only in the packed copy (`keep_weight` keeps the
    original as `weight` too: a tied LM head, whose tensor the embedding holds anyway, or a layer read elsewhere).
    fp32 layers without it answer `weight` with an unpacked copy (for the rare reader: quantisation, autograd)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.keep_weight = keep_weight
        if keep_weight:
            self.weight = weight                                 # before `packed`: see __getattr__
        self.packed = pack_weight(weight)                        # not a buffer: .to() and state_dict skip it
        # bytes the packed copy holds (fp32 panels pad N to a multiple of 16; oneDNN's blocked copy: the weight's)
        self.packed_nbytes = (self.packed.nbytes if isinstance(self.packed, RowsWeight)
                              else weight.numel() * weight.element_size())

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            packed = self.__dict__.get("packed")
            if name == "weight" and isinstance(packed, RowsWeight):
                return packed.weight
            raise

    def release(self) -> int:
        """Drops the packed copy (the layer cannot run after this; its FFN went elsewhere) -> the bytes it held."""
        freed, self.packed, self.packed_nbytes = self.packed_nbytes, None, 0
        return freed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError("this PackedLinear was released (its weights went to expert shards); it cannot run")
        if self.keep_weight and torch.is_grad_enabled() and x.requires_grad:
            return F.linear(x, self.weight, self.bias)           # autograd through the kept weight itself
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module, keep_weight: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> int:
    """Replaces every bf16 or fp32 CPU nn.Linear of `model` (exact type) that `packable` accepts by a PackedLinear,
    in place; modules whose name ends with an entry of `skip` stay as they are, those ending with one of
    `keep_weight` keep `weight` too. -> the number of layers packed (0 where packing does not apply: another dtype
    or device, no oneDNN for bf16, no AVX2 kernel for fp32)."""
    todo = [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and packable(m.weight) and not name.endswith(skip)]
    for name, m in todo:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(m.weight, m.bias, keep_weight=name.endswith(keep_weight)))
    return len(todo)
