"""QWeight: a BlockQuant laid out once at load in the order the quantised kernels stream it (qgemm_layout), with
the descriptor that qgemm.c, qgemm_amx.c and qgemm_avx2.c read (qgemm_desc.h)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.ops.block_quant import BlockQuant, QuantFormatError
from shared.ops.qgemm_layout import UNIT, fits_f16, kernel_form, pack, unpack


class QWeight:
    """A BlockQuant laid out for qgemm.c: `data` [U, B, record] uint8 and the kernel's descriptor `desc`. Not a
    tensor subclass, so `.to()` and state_dict never see it."""

    def __init__(self, bq: BlockQuant) -> None:
        n, k = bq.shape
        if bq.block not in (16, 32) or k % bq.block or bq.bits not in (4, 8):
            raise QuantFormatError(f"cannot pack a [{n}, {k}] weight of {bq.bits}-bit codes in blocks of {bq.block}")
        self.out_features, self.in_features, self.block = n, k, bq.block
        kf = kernel_form(bq)
        self.kind, sf16, mf16 = kf.kind, fits_f16(kf.scales), fits_f16(kf.mins)
        self.data = pack(kf, bq.block, sf16, mf16)
        self.table = (kf.table if kf.table is not None else torch.zeros(128, dtype=torch.uint8)).contiguous()
        # [U * 32] fp32: the factor of each output column (padding columns 1), or None
        self.col_scale = (None if bq.col_scale is None else
                          F.pad(bq.col_scale.float(), (0, -n % UNIT), value=1.0).contiguous())
        self.exact_bf16 = _exact_bf16(kf, bq)
        self._meta = (sf16, mf16, kf.mins is not None, self.table, kf.high, kf.shift, self.col_scale)
        shift_bits = int(torch.tensor([kf.shift], dtype=torch.float32).view(torch.int32).item())
        self.desc = torch.tensor([self.data.data_ptr(), self.table.data_ptr(), kf.high, kf.kind, bq.block // 2,
                                  int(sf16), int(mf16), int(kf.mins is not None), k // bq.block,
                                  self.data.shape[-1], shift_bits,
                                  0 if self.col_scale is None else self.col_scale.data_ptr(), int(self.exact_bf16)],
                                 dtype=torch.int64)
        self.desc_ptr = self.desc.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantise(self) -> torch.Tensor:
        """[N, K] fp32 from the packed form: the weight the kernel multiplies by (the file's, exactly)."""
        return unpack(self.data, self.out_features, self.in_features, self.kind, self.block, *self._meta)


def _exact_bf16(kf, bq: BlockQuant) -> bool:
    """Whether every weight's value(code) * scale is itself a bf16 number (kind 4 without mins or shift: NVFP4's
    E2M1 values times its fp8 block scales), so the AMX kernel may multiply those products as bf16 weights over the
    whole of K instead of scaling each block's sum."""
    if kf.kind != 4 or kf.mins is not None or kf.shift != 0.0:
        return False
    scales = kf.scales.float().unique()
    if not torch.equal(scales.bfloat16().float(), scales):
        return False
    products = bq.lut.float()[:, None] * scales[None, :]                    # exact in fp32: 3 + 8 mantissa bits
    return bool(torch.equal(products.bfloat16().float(), products))
