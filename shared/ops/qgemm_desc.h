// The descriptor of a packed block-quantised weight (shared/ops/qgemm_layout.py lays it out), shared by every
// quantised kernel: qgemm.h's AVX-512 ones and qgemm_avx2.c. No intrinsics here, so any -m flags can include it.
#ifndef UPESI_QGEMM_DESC_H
#define UPESI_QGEMM_DESC_H

#define UNIT 32   // output columns per unit of work (two panels)

// desc [13] int64: data, table (128 bytes: the low and then the high bytes of 16 bf16 values, each 16-byte half once
// per lane), the high byte of every expanded weight (kind 7), kind, bkk (8 / 16), scale_f16, min_f16, has_min, nb,
// record bytes, shift (an fp32's bits), cols (fp32 [N padded to a unit]: each output column's factor, or 0 for
// none), exact (every e * scale is a bf16 number: kind 4, no mins, shift 0). Kinds:
//   5  4-bit codes of an affine table: e = 16 + code, from the nibble in place (Q4_0, Q4_1, Q4_K)
//   4  4-bit codes of another table: e = the table's bf16 value, shift 0 (NVFP4's E2M1 values)
//   7  8-bit codes of a range under 128: e = the bf16 (high, byte) (Q5_K, Q6_K)
//   8  int8 codes: e = the code, converted (Q8_0)
// The weight is w = ((e - shift) * scale + min) * cols[column], per block of 2 bkk features of one column.
enum { D_DATA, D_TABLE, D_HIGH, D_KIND, D_BKK, D_SF16, D_MF16, D_MIN, D_NB, D_RECORD, D_SHIFT, D_COLS, D_EXACT };
#endif
