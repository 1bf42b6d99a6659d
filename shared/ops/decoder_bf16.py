"""A Llama-style decoder stack in one C call for a step's few rows, bf16 on CPUs with AVX512-BF16
(decoder_bf16.c), and SwiGLU's silu(gate) * up in C for bf16 rows of any count.

At batch 1 the default model's 30 layers cost about a dozen Python-level calls each (norms, the rows GEMM, RoPE +
KV store, attention, residual adds, the activation): over a third of a decode step went to dispatching them rather
than to streaming the weights (docs/performance.md). `DecoderStack.run` makes the same kernel calls from C, in the
same order and with the same roundings, so its result equals the module path's bit for bit
(tests/unit/test_decoder_bf16.py); the modules stay the reference and the path for everything else (prefills,
fp32, other devices, layers of another kind). `silu_mul` is that activation for the module path too, so both paths
agree; its reference is torch's F.silu(gate) * up, which it matches to a bf16 rounding.

Built with shared.ops.c_build at first use; UPESI_CPU_DECODER=0, no avx512_bf16 or a failed build leave the module
path. Shapes: T = rows, D = hidden, I = intermediate, L = layers.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.ops import (c_build, cpu_attention, decoder_f32, prefill_attention, qgemm, qgemm_avx2, qgemm_i8, rms_norm,
                        rows_gemm_bf16)
from shared.ops.cpu_features import cpu_flags
from shared.ops.paged_attention import AttentionMetadata
from shared.ops.qgemm import QWeight
from shared.ops.qgemm_i8 import QWeightI8
from shared.ops.rows_gemm_bf16 import RowsWeightBF16

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-ffp-contract=off", "-fopenmp",
         "-shared", "-fPIC"]

def max_rows() -> int:
    """Rows a step may have to go through C (more take the module path: prefills)."""
    return rows_gemm_bf16.MAX_ROWS

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.cache
def _lib() -> ctypes.CDLL | None:
    if "avx512_bf16" not in cpu_flags():
        return None
    lib = c_build.load_or_none(SOURCE, FLAGS, "UPESI_CPU_DECODER", "CPU decoder kernel")
    if lib is None:
        return None
    lib.upesi_silu_mul_bf16.argtypes = [_P, _I, _I, _I, _P, ctypes.c_int]
    lib.upesi_decoder_bf16.argtypes = [_P, _P, _P, _F, _F, _P, _I, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _P, _I]
    for fn in (lib.upesi_silu_mul_bf16, lib.upesi_decoder_bf16):
        fn.restype = None
    return lib


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: torch's silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate, then up) -> silu(gate) * up [..., I]; in C for bf16 on CPU where it runs, and for
    fp32 where the fp32 decoder stack runs (decoder_f32)."""
    if decoder_f32.takes_silu(gate_up):
        return decoder_f32.silu_mul(gate_up)
    if (gate_up.dtype != torch.bfloat16 or gate_up.device.type != "cpu" or _lib() is None
            or (torch.is_grad_enabled() and gate_up.requires_grad)):
        return silu_mul_reference(gate_up)
    two_i = gate_up.shape[-1]
    x = gate_up.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], two_i // 2, dtype=torch.bfloat16)
    if x.shape[0]:
        _lib().upesi_silu_mul_bf16(x.data_ptr(), x.shape[0], x.stride(0), two_i // 2, out.data_ptr(),
                                   torch.get_num_threads())
    return out.view(*gate_up.shape[:-1], two_i // 2)


@functools.cache
def available() -> bool:
    """True where this library and every kernel it calls run on this machine."""
    return (_lib() is not None and rows_gemm_bf16.available() and rms_norm.available()
            and cpu_attention.available())


def _fn(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer as the C stack reads it: norms [D], packed linears (+ biases), the layer's KV cache. A
    linear is bf16 panels (rows_gemm_bf16) or block-quantised (qgemm), each layer's own choice."""
    norm1: torch.Tensor
    qkv: RowsWeightBF16 | QWeight | QWeightI8
    qkv_bias: torch.Tensor | None
    o: RowsWeightBF16 | QWeight | QWeightI8
    o_bias: torch.Tensor | None
    norm2: torch.Tensor
    gate_up: RowsWeightBF16 | QWeight | QWeightI8
    gate_up_bias: torch.Tensor | None
    down: RowsWeightBF16 | QWeight | QWeightI8
    down_bias: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    window: int | None = None              # sliding window of the layer's attention


def _weight(w: RowsWeightBF16 | QWeight | QWeightI8) -> torch.Tensor:
    """What the GEMM of `w` takes as its weight: bf16 panels, or a quantised weight's descriptor."""
    return w.desc if isinstance(w, (QWeight, QWeightI8)) else w.panels


def _gemm(w: RowsWeightBF16 | QWeight | QWeightI8, dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return qgemm_avx2.kernel_address()
    if isinstance(w, QWeightI8):
        return qgemm_i8.kernel_address()
    return qgemm.kernel_address() if isinstance(w, QWeight) else rows_gemm_bf16.kernel_address()


class DecoderStack:
    """The layers' pointers, gathered once; `run` takes a step's rows through every layer. It holds references to
    every tensor it points into, so none can be freed under it."""

    def __init__(self, layers: list[LayerWeights], heads: int, kv_heads: int, head_dim: int, eps: float,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        """dtype: bf16 (decoder_bf16.c), or fp32 with every linear a QWeight (decoder_f32.c)."""
        lw = layers[0]
        self.dtype = dtype
        self.hidden, self.inter = lw.o.out_features, lw.down.in_features
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.scale = head_dim ** -0.5
        self.block_size = lw.k_cache.shape[1]
        self._keep = [[t.to(dtype).contiguous() if isinstance(t, torch.Tensor) else t
                       for t in (lw_.norm1, lw_.qkv_bias, lw_.o_bias, lw_.norm2, lw_.gate_up_bias, lw_.down_bias)]
                      for lw_ in layers]
        ptrs = []
        for lw_, (n1, bq, bo, n2, bg, bd) in zip(layers, self._keep):
            linears = (lw_.qkv, lw_.o, lw_.gate_up, lw_.down)
            p = [n1, _weight(lw_.qkv), bq, _weight(lw_.o), bo, n2, _weight(lw_.gate_up), bg, _weight(lw_.down), bd,
                 lw_.k_cache, lw_.v_cache]
            ptrs.append([0 if t is None else t.data_ptr() for t in p] + [lw_.window or 0]
                        + [_gemm(w, dtype) for w in linears] + [0])
        self._layers = layers
        self._ptrs = torch.tensor(ptrs, dtype=torch.int64)                      # [L, 18]
        self._wide = self._wide_ptrs(ptrs, layers)                               # [L, 18] or None
        self._run = _lib().upesi_decoder_bf16 if dtype == torch.bfloat16 else decoder_f32._lib().upesi_decoder_f32
        # prompt chunks go to the prefill kernel of their dtype where it runs, as the module path sends them
        prefill = (_fn(prefill_attention.kernel(), "upesi_prefill_attention")
                   if dtype == torch.bfloat16 and prefill_attention.available(head_dim)
                   else prefill_attention.f32_kernel(head_dim) if dtype == torch.float32 else 0)
        self._chunks = bool(prefill)
        self._fns = torch.tensor([_fn(rms_norm._lib(), "upesi_rms_norm"),
                                  _fn(cpu_attention._lib(), "upesi_rope_store"),
                                  _fn(cpu_attention._lib(), "upesi_paged_attention"), prefill,
                                  _fn(rms_norm._lib(), "upesi_add_rms_norm")], dtype=torch.int64)

    def _wide_ptrs(self, ptrs: list[list[int]], layers: list[LayerWeights]) -> torch.Tensor | None:
        """The layer table for steps of qgemm.WIDE_ROWS rows or more (a prefill's chunk): each block-quantised
        linear on the fused dequantise-GEMM, as qgemm.run multiplies such rows, bf16 panels on their own kernel;
        a block-quantised gate_up (I a multiple of 32) on AMX's GEMM that writes SwiGLU's activation itself.
        None where one of them has no such call (fp32, int8 activations, K not a multiple of 32, no fused
        kernel here): those steps take the module path."""
        if self.dtype != torch.bfloat16:
            return None
        wide, out, swiglu = None, [], qgemm.wide_swiglu_address()
        for row, lw in zip(ptrs, layers):
            linears = (lw.qkv, lw.o, lw.gate_up, lw.down)
            if any(isinstance(w, QWeightI8) or (isinstance(w, QWeight) and w.in_features % 32) for w in linears):
                return None
            if wide is None and any(isinstance(w, QWeight) for w in linears):
                wide = qgemm.wide_kernel_address()
                if not wide:
                    return None
            gemms = [wide if isinstance(w, QWeight) else row[-5 + i] for i, w in enumerate(linears)]
            act = swiglu if isinstance(lw.gate_up, QWeight) and lw.gate_up.out_features % 64 == 0 else 0
            out.append(row[:-5] + gemms + [act])
        return torch.tensor(out, dtype=torch.int64)

    def _table(self, t: int) -> torch.Tensor | None:
        """The layer table for a step of t rows: the rows kernels' up to qgemm.WIDE_ROWS, the wide one's up to
        qgemm.fused_max_rows() (and only with the prefill kernel for the long chunks), else None; fp32 stacks at most
        max_rows()."""
        if t <= max_rows() or (t < qgemm.WIDE_ROWS and self.dtype == torch.bfloat16):
            return self._ptrs
        return self._wide if self._chunks and t <= qgemm.fused_max_rows() else None

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step's rows x [T, D] can go through C: the stack's dtype on CPU, a layer table for T rows
        (every linear's kernel as the module path calls it), every sequence's new rows within the row attention
        kernel's limit or, a prefill's longer chunk, for the prefill kernel (no tree)."""
        t = x.shape[0]
        if x.dtype != self.dtype or t == 0 or torch.is_grad_enabled():
            return False
        if t <= max_rows() and meta.max_query_len <= cpu_attention.MAX_ROWS:
            return True
        return (self._chunks and self._table(t) is not None
                and all(n <= cpu_attention.MAX_ROWS or b not in meta.tree_masks
                        for b, n in enumerate(meta.query_lens)))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, D] (the embeddings), cos / sin [T, R] (R: the rotated dims of a head), all in the stack's dtype ->
        the residual stream after the last layer [T, D] (before the final norm)."""
        x = x.contiguous()                           # updated in place: the caller's embeddings, a fresh tensor
        cos, sin = cos.contiguous(), sin.contiguous()
        rows, blocks, long, longest, widest = cpu_attention.row_descriptors(meta, self._chunks,
                                                                            self.dtype == torch.float32)
        chunks = torch.tensor([(b, lo, meta.query_lens[b], meta.seq_lens_host[b]) for b, lo in long],
                              dtype=torch.int64).view(-1, 4)                 # [NC, 4]
        dims = torch.tensor([len(self._layers), self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter,
                             self.block_size, torch.get_num_threads(), cos.shape[-1]], dtype=torch.int64)
        bt = meta.block_tables
        table = self._table(x.shape[0])
        self._run(self._fns.data_ptr(), dims.data_ptr(), table.data_ptr(), self.eps,
                  self.scale, x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
                  bt.data_ptr(), bt.shape[1], rows.data_ptr(), blocks.data_ptr(), len(blocks), longest, widest,
                  chunks.data_ptr(), len(chunks))
        return x
