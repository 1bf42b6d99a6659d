// Linear layers whose weights stay block-quantised, for fp32 rows on x86-64 CPUs with AVX2, FMA and F16C, where
// qgemm.c's AVX512-BF16 kernels do not run (shared/ops/qgemm.py loads this). It reads the same packed layout
// (qgemm_desc.h; qgemm.c describes the records).
//
// Per unit of 32 output columns and block, each code becomes an exact fp32 number e' (a 4-bit code, kind 5; an
// E2M1 value, 4; the bf16 number e, 7; an int8, 8), and the block's sum is scaled into the row's fp32 total:
//     y[c] += scale[c, b] * (sum_{i in b} e'(code[c, i]) * x[i] - corr * sx[b])  +  min[c, b] * sx[b]
// where sx[b] is the row's sum of x over the block and corr = shift - (16 for kind 5, else 0), so that e' - corr is
// the code's value: the dequantised weight's product up to the order of fp32 sums (and corr's cancellation).
// Two forms of the sums:
//   column form (kind 5, and 4 when its table doubled is int8, as E2M1's is): vectors of 8 columns of one
//     feature, each column summing its block's features in order in one register (rows_block_cols);
//   pair form (the others): vectors of 4 columns' two features side by side as the packed bytes hold them, a row's
//     pair of x values broadcast as (x0, x1, x0, x1, ...), the two features' lanes added at the block's end
//     (rows_block, over expand's buffer; for one row of kind 8, an LM head's usual type, straight from the codes).
// Every output is the same sequence of operations whatever other rows share the call, so a verification row is
// computed exactly as a decode row.
// Shapes: M = rows, K = in features, N = out features, NB = blocks, BKK = feature pairs per block.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm_desc.h"

#define MR 3      // rows per register tile (pair form, one panel: 12 accumulators)
#define TILE_ROWS 6  // rows per register tile (column form, one panel: 12 accumulators)
#define PREFETCH 4  // records read ahead: a step's weights stream from memory (a 49152 x 576 Q8_0 head at one row,
                    // 2 threads: 2.6-2.7 ms against 3.6-4.1 without, EPYC-AVX2)

typedef struct {
    const uint8_t *data;
    const float *cols;  // the columns' factors, or NULL
    int kind, bkk, sf16, mf16, has_min;
    float corr;
    __m256 t0, t1;      // kind 4: the 16 table values as fp32
    __m128i t8;         // kind 4: twice them as int8, where int_table (E2M1's are)
    int int_table;
    __m256i high;       // kind 7: the shared high byte, in place above the code byte
    int64_t nb, record, code_bytes, ss, ms;
} qdesc;

static qdesc read_desc(const int64_t *desc) {
    qdesc q;
    q.data = (const uint8_t *)desc[D_DATA];
    q.kind = (int)desc[D_KIND];
    q.bkk = (int)desc[D_BKK];
    q.sf16 = (int)desc[D_SF16];
    q.mf16 = (int)desc[D_MF16];
    q.has_min = (int)desc[D_MIN];
    q.cols = (const float *)desc[D_COLS];
    int32_t shift_bits = (int32_t)desc[D_SHIFT];
    float shift;
    memcpy(&shift, &shift_bits, 4);
    q.corr = shift - (q.kind == 5 ? 16.0f : 0.0f);
    const uint8_t *t = (const uint8_t *)desc[D_TABLE];
    float v[16];
    for (int i = 0; i < 16; i++) {
        uint32_t bits = (uint32_t)(t[i] | t[64 + i] << 8) << 16;     // the value's bf16 bits, widened
        memcpy(v + i, &bits, 4);
    }
    int8_t t8[16];
    q.int_table = 1;
    for (int i = 0; i < 16; i++) {
        float d = 2.0f * v[i];
        q.int_table &= d == (float)(int)d && d >= -127.0f && d <= 127.0f;
        t8[i] = q.int_table ? (int8_t)d : 0;
    }
    q.t8 = _mm_loadu_si128((const __m128i *)t8);
    q.t0 = _mm256_loadu_ps(v);
    q.t1 = _mm256_loadu_ps(v + 8);
    q.high = _mm256_set1_epi32((int32_t)(desc[D_HIGH] << 8));
    q.nb = desc[D_NB];
    q.record = desc[D_RECORD];
    q.code_bytes = (int64_t)2 * q.bkk * (q.kind == 4 || q.kind == 5 ? 16 : 32);
    q.ss = q.sf16 ? 2 : 4;
    q.ms = q.mf16 ? 2 : 4;
    return q;
}

static inline __m256i load8_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

// E2M1 (or any 16-entry) table lookup of 8 indices 0-15.
static inline __m256 lookup(const qdesc *q, __m256i idx) {
    __m256 lo = _mm256_permutevar8x32_ps(q->t0, idx), hi = _mm256_permutevar8x32_ps(q->t1, idx);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));      // bit 3 picks the half
}

#define AT(kk, p, g) ((((kk) * 2 + (p)) * 4) + (g))

// One block of a unit -> buf [BKK][2 panels][4 groups] of 8 lanes (columns 4g + l / 2 of the panel, feature l % 2).
static inline void expand(const qdesc *q, const uint8_t *codes, __m256 *buf) {
    const __m256i m4 = _mm256_set1_epi32(15);
    if (q->kind == 5) {          // 64 bytes per 2 pairs: word 2 col + feat, nibble j: pair 2c + j / 2, panel j % 2
        for (int c = 0; c < q->bkk / 2; c++)
            for (int g = 0; g < 4; g++) {
                __m256i d = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(codes + 64 * c + 16 * g)));
                for (int j = 0; j < 4; j++)
                    buf[AT(2 * c + j / 2, j % 2, g)] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d, 4 * j),
                                                                                            m4));
            }
    } else if (q->kind == 4) {   // 64 bytes per 2 pairs: byte 16 g + 8 panel + lane; low nibble pair 2c, high 2c + 1
        for (int c = 0; c < q->bkk / 2; c++)
            for (int p = 0; p < 2; p++)
                for (int g = 0; g < 4; g++) {
                    __m256i d = load8_u8(codes + 64 * c + 16 * g + 8 * p);
                    buf[AT(2 * c, p, g)] = lookup(q, _mm256_and_si256(d, m4));
                    buf[AT(2 * c + 1, p, g)] = lookup(q, _mm256_srli_epi32(d, 4));
                }
    } else if (q->kind == 7) {   // 64 bytes per pair, bytes as kind 4's: e = the bf16 (high, byte)
        for (int kk = 0; kk < q->bkk; kk++)
            for (int p = 0; p < 2; p++)
                for (int g = 0; g < 4; g++) {
                    __m256i d = _mm256_or_si256(load8_u8(codes + 64 * kk + 16 * g + 8 * p), q->high);
                    buf[AT(kk, p, g)] = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
                }
    } else {                     // 32 bytes per pair and panel: byte 2 col + feat, int8
        for (int kk = 0; kk < q->bkk; kk++)
            for (int p = 0; p < 2; p++)
                for (int g = 0; g < 4; g++) {
                    __m128i b = _mm_loadl_epi64((const __m128i *)(codes + 32 * (2 * kk + p) + 8 * g));
                    buf[AT(kk, p, g)] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                }
    }
}

static inline __m256 load8_scales(const uint8_t *p, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}

// A block's scales and mins: [panel][half] of 8 columns each.
static inline void block_scales(const qdesc *q, const uint8_t *rec, __m256 sc[2][2], __m256 mn[2][2]) {
    const uint8_t *sp = rec + q->code_bytes, *mp = sp + 32 * q->ss;
    for (int p = 0; p < 2; p++)
        for (int h = 0; h < 2; h++) {
            sc[p][h] = load8_scales(sp + (16 * p + 8 * h) * q->ss, q->sf16);
            mn[p][h] = q->has_min ? load8_scales(mp + (16 * p + 8 * h) * q->ms, q->mf16) : _mm256_setzero_ps();
        }
}

// Kind 8's vector (kk, p, g) as expand() stores it: 8 int8 codes, 4 columns' two features side by side.
static inline __m256 int8_pairs(const uint8_t *codes, int kk, int p, int g) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 32 * (2 * kk + p) +
                                                                                     8 * g))));
}

// Rows r < mr (x ldx apart, at the block's first feature) times panels p0 .. p0 + np - 1 of one expanded block:
// tot [rows][32] += scale * (sum - corr * sx) + min * sx. mr and np are constants at every call site. i8: kind 8's
// codes, whose vectors are then made in registers (int8_pairs) instead of read from buf: the same values.
static inline __attribute__((always_inline)) void rows_block(const qdesc *q, const float *x, int64_t ldx, int mr,
                                                             int p0, int np, const __m256 *buf, const uint8_t *i8,
                                                             __m256 sc[2][2], __m256 mn[2][2], const float *sx,
                                                             float *tot) {
    __m256 a[MR][8];
    for (int r = 0; r < MR; r++)
        for (int i = 0; i < 8; i++)
            a[r][i] = _mm256_setzero_ps();
    for (int kk = 0; kk < q->bkk; kk++) {
        __m256 xv[MR];
        for (int r = 0; r < mr; r++)
            xv[r] = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(x + r * ldx + 2 * kk)));
        for (int p = 0; p < np; p++)
            for (int g = 0; g < 4; g++) {
                __m256 w = i8 ? int8_pairs(i8, kk, p0 + p, g) : buf[AT(kk, p0 + p, g)];
                for (int r = 0; r < mr; r++)
                    a[r][4 * p + g] = _mm256_fmadd_ps(xv[r], w, a[r][4 * p + g]);
            }
    }
    for (int r = 0; r < mr; r++) {
        __m256 s = _mm256_set1_ps(sx[r * q->nb]), corr = _mm256_set1_ps(q->corr * sx[r * q->nb]);
        for (int p = 0; p < np; p++)
            for (int h = 0; h < 2; h++) {
                // lanes (c0f0 + c0f1, c1.., c4.., c5.. | c2.., c3.., c6.., c7..) -> columns 0-7 of the half
                __m256 v = _mm256_hadd_ps(a[r][4 * p + 2 * h], a[r][4 * p + 2 * h + 1]);
                v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8));
                float *t = tot + UNIT * r + 16 * (p0 + p) + 8 * h;
                __m256 out = _mm256_fmadd_ps(_mm256_sub_ps(v, corr), sc[p0 + p][h], _mm256_loadu_ps(t));
                if (q->has_min)
                    out = _mm256_fmadd_ps(mn[p0 + p][h], s, out);
                _mm256_storeu_ps(t, out);
            }
    }
}

// The column form, for kinds 5 and 4 (when its table doubled is int8): vectors of 8 columns of one feature, so
// each column sums its block's features in order in one register, with no lane pairs to add at the end.
// Kind 5: a 32-byte load holds 8 columns' 16-bit words, feature 0's in the low half of each lane and feature 1's
// in the high; nibble j of feature f sits at bit 16 f + 4 j. Masking it in place and converting gives
// code * 2^(16 f + 4 j) exactly (an op fewer than shifting it down first); the row's x was scaled by
// 2^-(16 f + 4 j) beforehand (xs), so each product is code * x exactly (unless x is below 2^-100). The top nibble
// (f 1, j 3) would be negative as an int32: it is shifted down instead, and its x is unscaled.
// Kind 4: 16 bytes (from two 8-byte groups) hold 8 columns' two features side by side; one byte shuffle splits the
// features, and the nibbles become int8 values (2 x E2M1) through a byte table.
static inline __m256 nibble(__m256i d, int j, int f) {
    return j == 3 && f == 1 ? _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 28))
                            : _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15 << (16 * f + 4 * j))));
}

static inline __m256 int8_low(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
static inline __m256 int8_high(__m128i b) { return int8_low(_mm_unpackhi_epi64(b, b)); }

// Columns 0-7 of a panel half, two features side by side -> feature 0's 8 bytes, then feature 1's.
static inline __m128i feature_bytes(const uint8_t *lo, const uint8_t *hi) {
    __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)lo), _mm_loadl_epi64((const __m128i *)hi));
    return _mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
}

// One row's sums a0, a1 (panel p's halves) into tot [32] at the row: tot += scale * (a - corr * sx) + min * sx,
// for kind 4 with a halved first (its int8 values are 2 x E2M1). sx: the row's block sum.
static inline __attribute__((always_inline)) void cols_out(const qdesc *q, int kind, __m256 a0, __m256 a1, int p,
                                                           __m256 sc[2][2], __m256 mn[2][2], float sx, float *tot) {
    const __m256 vscale = _mm256_set1_ps(kind == 4 ? 0.5f : 1.0f), s = _mm256_set1_ps(sx);
    const __m256 corr = _mm256_set1_ps(q->corr * sx);
    for (int h = 0; h < 2; h++) {
        float *t = tot + 16 * p + 8 * h;
        __m256 v = _mm256_sub_ps(_mm256_mul_ps(h ? a1 : a0, vscale), corr);
        __m256 out = _mm256_fmadd_ps(v, sc[p][h], _mm256_loadu_ps(t));
        if (q->has_min)
            out = _mm256_fmadd_ps(mn[p][h], s, out);
        _mm256_storeu_ps(t, out);
    }
}

enum { DIRECT, EXPAND };   // rows_block_cols' modes

// One block in the column form, rows r < mr <= 3 (x: xs, rows ldxs apart, panel p's copy pstride on), each
// vector expanded from the codes and multiplied at once; EXPAND also stores the vectors in vb, in the order
// tile_cols reads them. Then tot as rows_block. kind, mode and mr are constants.
static inline __attribute__((always_inline)) void rows_block_cols(const qdesc *q, int kind, int mode,
                                                                  const uint8_t *codes, __m256 *vb,
                                                                  const float *xs, int64_t ldxs, int64_t pstride,
                                                                  int mr, __m256 sc[2][2], __m256 mn[2][2],
                                                                  const float *sx, float *tot) {
    __m256 a[3][2][2];
#pragma GCC unroll 12
    for (int i = 0; i < 12; i++)
        a[i / 4][i / 2 % 2][i % 2] = _mm256_setzero_ps();
    int n = 0;
#define ACC(p, h, v, feat)                                                                                        \
    do {                                                                                                          \
        __m256 v_ = (v);                                                                                          \
        if (mode == EXPAND)                                                                                       \
            vb[n++] = v_;                                                                                         \
        _Pragma("GCC unroll 3") for (int r = 0; r < mr; r++)                                                      \
            a[r][p][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xs + r * ldxs + (p) * pstride + (feat)), v_,         \
                                         a[r][p][h]);                                                             \
    } while (0)
    if (kind == 5) {
        for (int c = 0; c < q->bkk / 2; c++) {
            __m256i d[2];
            for (int h = 0; h < 2; h++)
                d[h] = _mm256_loadu_si256((const __m256i *)(codes + 64 * c + 32 * h));
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
#pragma GCC unroll 2
                for (int f = 0; f < 2; f++)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++)
                        ACC(j % 2, h, nibble(d[h], j, f), 4 * c + 2 * (j / 2) + f);
        }
    } else {
        const __m128i low4 = _mm_set1_epi8(0x0F);
        for (int c = 0; c < q->bkk / 2; c++)
#pragma GCC unroll 2
            for (int p = 0; p < 2; p++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const uint8_t *at = codes + 64 * c + 32 * h + 8 * p;
                    __m128i s = feature_bytes(at, at + 16);
                    __m128i lo = _mm_shuffle_epi8(q->t8, _mm_and_si128(s, low4));
                    __m128i hi = _mm_shuffle_epi8(q->t8, _mm_and_si128(_mm_srli_epi16(s, 4), low4));
                    ACC(p, h, int8_low(lo), 4 * c);
                    ACC(p, h, int8_high(lo), 4 * c + 1);
                    ACC(p, h, int8_low(hi), 4 * c + 2);
                    ACC(p, h, int8_high(hi), 4 * c + 3);
                }
    }
#undef ACC
#pragma GCC unroll 3
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++)
            cols_out(q, kind, a[r][p][0], a[r][p][1], p, sc, mn, sx[r * q->nb], tot + UNIT * r);
}

// A row tile over one expanded block in the column form: rows r < mr times panels p0 .. p0 + np - 1, from the
// vectors EXPAND stored in vb, each accumulator summing its features in rows_block_cols's order (so a row's
// operations are those it has alone). mr * np <= 6: up to 12 accumulators, each broadcast of x feeding two.
static inline __attribute__((always_inline)) void tile_cols(const qdesc *q, int kind, const __m256 *vb,
                                                            const float *xs, int64_t ldxs, int64_t pstride, int mr,
                                                            int p0, int np, __m256 sc[2][2], __m256 mn[2][2],
                                                            const float *sx, float *tot) {
    __m256 a0[TILE_ROWS], a1[TILE_ROWS];             // [i = (p - p0) mr + r]: halves 0 and 1
#pragma GCC unroll 6
    for (int i = 0; i < TILE_ROWS; i++) {
        a0[i] = _mm256_setzero_ps();
        a1[i] = _mm256_setzero_ps();
    }
    for (int c = 0; c < q->bkk / 2; c++)
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++)                  // feature 4c + t
#pragma GCC unroll 2
            for (int p = p0; p < p0 + np; p++) {     // at: vb's index of (feature, panel, half 0)
                int at = kind == 5 ? ((c * 4 + p + 2 * (t / 2)) * 2 + t % 2) * 2 : (c * 2 + p) * 8 + t;
                __m256 v0 = vb[at], v1 = vb[at + (kind == 5 ? 1 : 4)];
#pragma GCC unroll 6
                for (int r = 0; r < mr; r++) {
                    __m256 xb = _mm256_broadcast_ss(xs + r * ldxs + p * pstride + 4 * c + t);
                    int i = (p - p0) * mr + r;
                    a0[i] = _mm256_fmadd_ps(xb, v0, a0[i]);
                    a1[i] = _mm256_fmadd_ps(xb, v1, a1[i]);
                }
            }
#pragma GCC unroll 2
    for (int p = p0; p < p0 + np; p++)
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++)
            cols_out(q, kind, a0[(p - p0) * mr + r], a1[(p - p0) * mr + r], p, sc, mn, sx[r * q->nb], tot + UNIT * r);
}

// All rows of the call over one block in the column form: up to 3 rows straight from the codes; more rows expand
// the vectors once into vb (with the first two rows' sums), then tiles of 6 rows x 16 columns (as rows_gemm.c's;
// kind 4, whose x is one copy for both panels: 3 rows x 32 columns) and smaller ones for the rest.
static inline __attribute__((always_inline)) void block_cols(const qdesc *q, int kind, const uint8_t *codes,
                                                             __m256 *vb, const float *xs, int64_t ldxs,
                                                             int64_t pstride, int64_t m, __m256 sc[2][2],
                                                             __m256 mn[2][2], const float *sx, float *tot) {
    if (m <= 3) {                                    // expanded in registers for each tile of rows
        if (m == 3)
            rows_block_cols(q, kind, DIRECT, codes, vb, xs, ldxs, pstride, 3, sc, mn, sx, tot);
        else if (m == 2)
            rows_block_cols(q, kind, DIRECT, codes, vb, xs, ldxs, pstride, 2, sc, mn, sx, tot);
        else
            rows_block_cols(q, kind, DIRECT, codes, vb, xs, ldxs, pstride, 1, sc, mn, sx, tot);
        return;
    }
    rows_block_cols(q, kind, EXPAND, codes, vb, xs, ldxs, pstride, 2, sc, mn, sx, tot);
    for (int64_t r0 = 2; r0 < m;) {
        const float *xr = xs + r0 * ldxs, *sxr = sx + r0 * q->nb;
        float *tr = tot + UNIT * r0;
        int64_t rest = m - r0;
        // 6 rows one panel at a time (12 accumulators), else both panels: kind 4's x serves them both, so one
        // broadcast feeds four vectors; the rest as 3 + 2 or 2 + 2
        int64_t rows = kind == 4 && rest >= 3 ? 3 : rest >= 6 ? 6 : rest >= 3 && rest != 4 ? 3 : rest >= 2 ? 2 : 1;
#define TILE(mr, p0, np) tile_cols(q, kind, vb, xr, ldxs, pstride, mr, p0, np, sc, mn, sxr, tr)
        if (rows == 6) {
            TILE(6, 0, 1);
            TILE(6, 1, 1);
        } else if (rows == 3) {
            TILE(3, 0, 2);
        } else if (rows == 2) {
            TILE(2, 0, 2);
        } else {
            TILE(1, 0, 2);
        }
#undef TILE
        r0 += rows;
    }
}

// xs [M][2][K]: x scaled for kind 5's column form, panel p's copy of feature i by 2^-(16 f + 4 j) with f = i % 2,
// j = 2 ((i / 2) % 2) + p (the top nibble's unscaled). Powers of two: exact (above fp32's subnormals).
static float *nibble_scaled(const float *x, int64_t m, int64_t ldx, int64_t k) {
    float *xs = malloc(sizeof(float) * (size_t)(m * 2 * k)), f[2][4];
    for (int p = 0; p < 2; p++)              // the factor of feature i % 4 in panel p: exact powers of two
        for (int i = 0; i < 4; i++) {
            int sh = 16 * (i % 2) + 4 * (2 * (i / 2) + p);
            f[p][i] = sh == 28 ? 1.0f : ldexpf(1.0f, -sh);
        }
    for (int64_t r = 0; r < m; r++)
        for (int p = 0; p < 2; p++)
            for (int64_t i = 0; i < k; i++)
                xs[(r * 2 + p) * k + i] = x[r * ldx + i] * f[p][i % 4];
    return xs;
}

// sx [M, NB]: each row's sum of x over each block, in one fixed order per row (malloc'd; the caller frees it).
static float *block_sums(const float *x, int64_t m, int64_t ldx, int64_t nb, int64_t bf) {
    float *sx = malloc(sizeof(float) * (size_t)(m * nb));
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * ldx + b * bf;
            __m256 acc = _mm256_loadu_ps(xb);
            for (int64_t i = 8; i < bf; i += 8)
                acc = _mm256_add_ps(acc, _mm256_loadu_ps(xb + i));
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            sx[r * nb + b] = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
        }
    return sx;
}

// x [M, K] fp32 rows (ldx apart), desc: the packed weight [N, K], bias [N] fp32 or NULL -> y [M, N] fp32 (ldy apart).
void upesi_qgemm_avx2(const float *x, int64_t m, int64_t ldx, int64_t k, const int64_t *desc, const float *bias,
                      int64_t n, float *y, int64_t ldy, int threads) {
    if (m <= 0)
        return;
    qdesc q = read_desc(desc);
    int64_t units = (n + UNIT - 1) / UNIT, bf = 2 * q.bkk;
    float *sx = block_sums(x, m, ldx, q.nb, bf), *xs = q.kind == 5 ? nibble_scaled(x, m, ldx, k) : NULL;
    #pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        __m256 *buf = aligned_alloc(32, sizeof(__m256) * 8 * (size_t)q.bkk);
        float *tot = aligned_alloc(32, sizeof(float) * UNIT * (size_t)m);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            memset(tot, 0, sizeof(float) * UNIT * (size_t)m);
            const uint8_t *rec = q.data + u * q.nb * q.record;
            for (int64_t b = 0; b < q.nb; b++, rec += q.record) {
                __m256 sc[2][2], mn[2][2];
                for (int64_t o = 0; o < q.record; o += 64)       // the record PREFETCH blocks on (past a unit's
                    _mm_prefetch((const char *)(rec + PREFETCH * q.record + o), _MM_HINT_T0);   // end: the next's)
                block_scales(&q, rec, sc, mn);
                if (q.kind == 5)
                    block_cols(&q, 5, rec, buf, xs + b * bf, 2 * k, k, m, sc, mn, sx + b, tot);
                else if (q.kind == 4 && q.int_table)
                    block_cols(&q, 4, rec, buf, x + b * bf, ldx, 0, m, sc, mn, sx + b, tot);
                else if (q.kind == 8 && m == 1)          // one row: kind 8's vectors straight from the codes
                    rows_block(&q, x + b * bf, ldx, 1, 0, 2, buf, rec, sc, mn, sx + b, tot);
                if (q.kind == 5 || (q.kind == 4 && q.int_table) || (q.kind == 8 && m == 1))
                    continue;
                expand(&q, rec, buf);
                for (int64_t r0 = 0; r0 < m; r0 += MR) {
                    const float *xr = x + r0 * ldx + b * bf, *sxr = sx + r0 * q.nb + b;
                    float *tr = tot + UNIT * r0;
                    int64_t rows = m - r0 < MR ? m - r0 : MR;
                    if (rows == 3) {
                        rows_block(&q, xr, ldx, 3, 0, 1, buf, NULL, sc, mn, sxr, tr);
                        rows_block(&q, xr, ldx, 3, 1, 1, buf, NULL, sc, mn, sxr, tr);
                    } else if (rows == 2) {
                        rows_block(&q, xr, ldx, 2, 0, 1, buf, NULL, sc, mn, sxr, tr);
                        rows_block(&q, xr, ldx, 2, 1, 1, buf, NULL, sc, mn, sxr, tr);
                    } else {
                        rows_block(&q, xr, ldx, 1, 0, 2, buf, NULL, sc, mn, sxr, tr);
                    }
                }
            }
            int64_t c0 = u * UNIT, cols = n - c0 < UNIT ? n - c0 : UNIT;
            for (int64_t r = 0; r < m; r++)
                for (int64_t c = 0; c < cols; c++)
                    y[r * ldy + c0 + c] = tot[UNIT * r + c] * (q.cols ? q.cols[c0 + c] : 1.0f)
                                          + (bias ? bias[c0 + c] : 0.0f);
        }
        free(buf);
        free(tot);
    }
    free(sx);
    free(xs);
}

// The weight dequantised: w [N, K] fp32 (ldw apart), each w = (e' - corr) * scale, then + min, then times the
// column's factor, rounded after each step as shared.ops.qgemm_layout.unpack computes it (no fused multiply-add),
// so equal to it bit for bit. For a prefill's many rows a matmul over it beats expanding the codes again for every
// few rows. Vectors in expand's pair form: lanes 2j, 2j + 1 are column 4g + j's two features, one 8-byte store.
void upesi_qgemm_avx2_dequant(const int64_t *desc, int64_t n, float *w, int64_t ldw, int threads) {
    qdesc q = read_desc(desc);
    int64_t units = (n + UNIT - 1) / UNIT, bf = 2 * q.bkk;
    const uint8_t *base = q.data;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && units > 1)
    for (int64_t u = 0; u < units; u++) {
        __m256 buf[128];
        float cf[UNIT];
        int64_t c0 = u * UNIT, cols = n - c0 < UNIT ? n - c0 : UNIT;
        for (int c = 0; c < UNIT; c++)
            cf[c] = q.cols && c < cols ? q.cols[c0 + c] : 1.0f;
        const __m256i dup[2] = {_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)};
        const __m256 corr = _mm256_set1_ps(q.corr);
        const uint8_t *rec = base + u * q.nb * q.record;
        for (int64_t b = 0; b < q.nb; b++, rec += q.record) {
            __m256 s[2][2], m2[2][2], vs[2][4], vm[2][4], vc[2][4];
            expand(&q, rec, buf);
            block_scales(&q, rec, s, m2);
            for (int p = 0; p < 2; p++)
                for (int g = 0; g < 4; g++) {      // per lane: column 16 p + 4 g + lane / 2's factors
                    vs[p][g] = _mm256_permutevar8x32_ps(s[p][g / 2], dup[g % 2]);
                    vm[p][g] = _mm256_permutevar8x32_ps(m2[p][g / 2], dup[g % 2]);
                    vc[p][g] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(cf + 16 * p + 8 * (g / 2)), dup[g % 2]);
                }
            float *wb = w + c0 * ldw + b * bf;
            for (int kk = 0; kk < q.bkk; kk++)
                for (int p = 0; p < 2; p++)
                    for (int g = 0; g < 4; g++) {
                        __m256 v = _mm256_mul_ps(_mm256_sub_ps(buf[AT(kk, p, g)], corr), vs[p][g]);
                        if (q.has_min)
                            v = _mm256_add_ps(v, vm[p][g]);
                        if (q.cols)
                            v = _mm256_mul_ps(v, vc[p][g]);
                        int col = 16 * p + 4 * g;
                        float *at = wb + col * ldw + 2 * kk;
                        __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
                        if (col + 4 <= cols) {
                            _mm_storel_pi((__m64 *)at, lo);
                            _mm_storeh_pi((__m64 *)(at + ldw), lo);
                            _mm_storel_pi((__m64 *)(at + 2 * ldw), hi);
                            _mm_storeh_pi((__m64 *)(at + 3 * ldw), hi);
                            continue;
                        }
                        float lanes[8];
                        _mm256_storeu_ps(lanes, v);
                        for (int j = 0; j < 4 && col + j < cols; j++)
                            memcpy(at + j * ldw, lanes + 2 * j, 2 * sizeof(float));
                    }
        }
    }
}
