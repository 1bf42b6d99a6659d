// The packed layout of block-quantised weights shared by qgemm.c (AVX512-BF16) and qgemm_amx.c (AMX): the
// descriptor, the expansion of a block's codes to bf16 and the scales' loads. qgemm.c describes the format.
#ifndef UPESI_QGEMM_H
#define UPESI_QGEMM_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm_desc.h"

// One 64-byte chunk of codes of kind 5 / kind 4 -> w[4]: pairs 2c and 2c + 1 of both panels (w[2 (pair - 2c) + panel]).
static inline void chunk5(__m512i v, __m512bh *w) {
    // nibble j of each 16-bit word is pair 2c + j / 2, panel j % 2;
    // (t & 0x0078) | 0x4180: the nibble as mantissa bits 3-6 of 16.0, i.e. 16 + code
    const __m512i mask = _mm512_set1_epi16(0x0078), one6 = _mm512_set1_epi16(0x4180);   // 16.0
    w[0] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), mask, one6, 0xEA);
    w[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), mask, one6, 0xEA);
    w[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 5), mask, one6, 0xEA);
    w[3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 9), mask, one6, 0xEA);
}

static inline void chunk4(__m512i v, __m512i table, __m512i high, __m512bh *w) {
    // low nibbles pair 2c, high nibbles 2c + 1; lane halves are the panels
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i n0 = _mm512_and_si512(v, low4), n1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    __m512i l0 = _mm512_shuffle_epi8(table, n0), h0 = _mm512_shuffle_epi8(high, n0);
    __m512i l1 = _mm512_shuffle_epi8(table, n1), h1 = _mm512_shuffle_epi8(high, n1);
    w[0] = (__m512bh)_mm512_unpacklo_epi8(l0, h0);
    w[1] = (__m512bh)_mm512_unpackhi_epi8(l0, h0);
    w[2] = (__m512bh)_mm512_unpacklo_epi8(l1, h1);
    w[3] = (__m512bh)_mm512_unpackhi_epi8(l1, h1);
}

// Whether chunk_pairs expands a kind (the others convert each code: expand's last branch).
static inline int in_chunks(int kind) {
    return kind == 5 || kind == 4 || kind == 7;
}

// Pairs 2c and 2c + 1 of a block of kind 5, 4 or 7 -> w[4] in registers (w[2 (pair - 2c) + panel]). Kinds 5 and 4:
// a 64-byte chunk per 2 pairs; kind 7: a 64-byte chunk per pair, lane halves the panels. Kind 4 reads `table` and
// `high` as the two byte tables, kind 7 `high` as the one high byte.
static inline __attribute__((always_inline)) void chunk_pairs(const uint8_t *codes, int kind, int c, __m512i table,
                                                              __m512i high, __m512bh *w) {
    if (kind == 5) {
        chunk5(_mm512_loadu_si512((const void *)(codes + 64 * c)), w);
    } else if (kind == 4) {
        chunk4(_mm512_loadu_si512((const void *)(codes + 64 * c)), table, high, w);
    } else {
        __m512i v0 = _mm512_loadu_si512((const void *)(codes + 128 * c));
        __m512i v1 = _mm512_loadu_si512((const void *)(codes + 128 * c + 64));
        w[0] = (__m512bh)_mm512_unpacklo_epi8(v0, high);
        w[1] = (__m512bh)_mm512_unpackhi_epi8(v0, high);
        w[2] = (__m512bh)_mm512_unpacklo_epi8(v1, high);
        w[3] = (__m512bh)_mm512_unpackhi_epi8(v1, high);
    }
}

// Expands one block of a unit into buf [BKK][2][32] bf16: feature pairs (2kk, 2kk + 1) of the unit's 32 columns.
static inline void expand(const uint8_t *codes, int kind, int bkk, __m512i table, __m512i high, __m512bh *buf) {
    if (in_chunks(kind)) {
        for (int c = 0; c < bkk / 2; c++)
            chunk_pairs(codes, kind, c, table, high, buf + 4 * c);
    } else {                     // 32 bytes per pair and panel: each column's two features side by side
        for (int i = 0; i < 2 * bkk; i++) {
            const uint8_t *c = codes + 32 * i;
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
            buf[i] = _mm512_cvtne2ps_pbh(hi, lo);             // columns 0-7 in the low half, 8-15 in the high
        }
    }
}

static inline __m512 load_scales(const uint8_t *p, int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps((const float *)p);
}


// Asks for the record PREFETCH records ahead of `rec` (one block of one unit), so memory keeps streaming while a
// block is expanded and multiplied (the hardware prefetchers alone leave the kernel 30% slower at one row).
#define PREFETCH 4
static inline void prefetch_ahead(const uint8_t *rec, int64_t record) {
    for (int64_t o = 0; o < record; o += 64)
        _mm_prefetch((const char *)rec + PREFETCH * record + o, _MM_HINT_T0);
}

// The descriptor's fields, read once per call.
typedef struct {
    const uint8_t *data;
    const float *cols;                                     // the columns' factors, or NULL
    __m512i table, high;
    int kind, bkk, sf16, mf16, has_min, exact;
    float shift;
    int64_t nb, record, code_bytes, ss, ms;
} qdesc;

static inline qdesc read_desc(const int64_t *desc) {
    qdesc q;
    q.data = (const uint8_t *)desc[D_DATA];
    q.kind = (int)desc[D_KIND];
    q.table = _mm512_loadu_si512((const void *)desc[D_TABLE]);
    q.high = q.kind == 4 ? _mm512_loadu_si512((const void *)(desc[D_TABLE] + 64))
                         : _mm512_set1_epi8((char)desc[D_HIGH]);
    q.bkk = (int)desc[D_BKK];
    q.sf16 = (int)desc[D_SF16];
    q.mf16 = (int)desc[D_MF16];
    q.has_min = (int)desc[D_MIN];
    int32_t shift_bits = (int32_t)desc[D_SHIFT];
    memcpy(&q.shift, &shift_bits, 4);
    q.nb = desc[D_NB];
    q.record = desc[D_RECORD];
    q.cols = (const float *)desc[D_COLS];
    q.exact = (int)desc[D_EXACT];
    q.code_bytes = (int64_t)2 * q.bkk * (q.kind == 4 || q.kind == 5 ? 16 : 32);
    q.ss = q.sf16 ? 2 : 4;
    q.ms = q.mf16 ? 2 : 4;
    return q;
}

// A block's scales (and mins) for the unit's two panels.
static inline void block_scales(const qdesc *q, const uint8_t *rec, __m512 *sc, __m512 *mn) {
    const uint8_t *sp = rec + q->code_bytes, *mp = sp + 32 * q->ss;
    sc[0] = load_scales(sp, q->sf16);
    sc[1] = load_scales(sp + 16 * q->ss, q->sf16);
    mn[0] = mn[1] = _mm512_setzero_ps();
    if (q->has_min) {
        mn[0] = load_scales(mp, q->mf16);
        mn[1] = load_scales(mp + 16 * q->ms, q->mf16);
    }
}

// out [NB]: one row's sum of x over each block, in one fixed order (the same whatever the call's other rows).
static inline void row_block_sums(const uint16_t *xr, int64_t nb, int64_t bf, float *out) {
    for (int64_t b = 0; b < nb; b++) {
        const uint16_t *xb = xr + b * bf;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < bf; i += 16)
            acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + i))), 16)));
        out[b] = _mm512_reduce_add_ps(acc);
    }
}

// sx [M, NB]: each row's sums (row_block_sums; malloc'd, the caller frees it).
static inline float *block_sums(const uint16_t *x, int64_t m, int64_t ldx, int64_t nb, int64_t bf) {
    float *sx = malloc(sizeof(float) * (size_t)(m * nb));
    for (int64_t r = 0; r < m; r++)
        row_block_sums(x + r * ldx, nb, bf, sx + r * nb);
    return sx;
}

// The lanes of 16 columns of which `left` (> 0) are below N, and bias [c .. c + 16) bf16 in fp32 on those lanes
// (zeros without a bias).
static inline __mmask16 lanes_below(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __m512 bias16(const uint16_t *bias, int64_t c, __mmask16 msk) {
    return bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(msk, bias + c)),
                                                        16))
                : _mm512_setzero_ps();
}

// tot [M, 32] fp32 (times the columns' factors cols [N'] when not NULL, + bias [N] bf16) -> y's columns c0 .. c0 +
// 32 (< n), bf16 rounded to nearest even, or fp32.
static inline void store_unit(const float *tot, int64_t m, const float *cols, const uint16_t *bias, int64_t n,
                              int64_t c0, void *y, int64_t ldy, int out_f32) {
    for (int half = 0; half < 2; half++) {
        int64_t left = n - c0 - 16 * half;
        if (left <= 0)
            break;
        __mmask16 msk = lanes_below(left);
        __m512 bv = bias16(bias, c0 + 16 * half, msk);
        __m512 cv = cols ? _mm512_loadu_ps(cols + c0 + 16 * half) : _mm512_set1_ps(1.0f);
        for (int64_t r = 0; r < m; r++) {                  // factor and bias in fp32, one rounding
            __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(tot + UNIT * r + 16 * half), cv, bv);
            if (out_f32)
                _mm512_mask_storeu_ps((float *)y + r * ldy + c0 + 16 * half, msk, v);
            else
                _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + c0 + 16 * half, msk,
                                         (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

// Two expanded pairs of one panel's 16 columns (lane c: features 2kk, 2kk + 1 of column c) -> their dequantised
// bf16 weights in the same order, each rounded once from w = (e - shift) * scale + min.
static inline __m512i dequant_pair(__m512i v, __m512 shift, __m512 sc, __m512 mn, __m512i interleave) {
    const __m512i high_half = _mm512_set1_epi32((int32_t)0xFFFF0000);
    __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
    __m512 w0 = _mm512_fmadd_ps(_mm512_sub_ps(lo, shift), sc, mn);
    __m512 w1 = _mm512_fmadd_ps(_mm512_sub_ps(hi, shift), sc, mn);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));   // w0 c, w1 c side by side
}

// A block's scales and mins, with the columns' factors of unit u taken in (scale * f, min * f) when `fold`, for
// the dequantising paths: w = (e - shift) * (scale f) + min f, rounded once.
static inline void dequant_scales(const qdesc *q, const uint8_t *rec, int64_t u, int fold, __m512 *sc, __m512 *mn) {
    block_scales(q, rec, sc, mn);
    for (int p = 0; fold && q->cols && p < 2; p++) {
        __m512 f = _mm512_loadu_ps(q->cols + u * UNIT + 16 * p);
        sc[p] = _mm512_mul_ps(sc[p], f);
        mn[p] = _mm512_mul_ps(mn[p], f);
    }
}

// Unit u's codes (rec: its first record) -> pan [2][KK][32] bf16: panel p, pair kk holds (w[16p + l, 2kk],
// w[16p + l, 2kk + 1]) (the panels of rows_gemm_bf16.c and rows_gemm_amx.c, which the wide kernels multiply).
// Kinds 5, 4 and 7 are dequantised straight from their expanded chunks (chunk_pairs), kind 8 through expand's
// buffer. Exact weights (q->exact) give e * scale itself, not rounded: their columns' factors are left to the sums
// (wide_cols).
static inline void dequant_unit(const qdesc *q, const uint8_t *rec, int64_t u, uint16_t *pan, int64_t kk_n) {
    const __m512 shift = _mm512_set1_ps(q->shift);
    static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_loadu_si512((const void *)order);    // word 2c <- c, 2c + 1 <- 16 + c
    __m512bh buf[32];
    for (int64_t b = 0; b < q->nb; b++, rec += q->record) {
        __m512 sc[2], mn[2];
        dequant_scales(q, rec, u, !q->exact, sc, mn);
        uint16_t *out = pan + b * q->bkk * 32;
        if (in_chunks(q->kind)) {
            for (int c = 0; c < q->bkk / 2; c++) {
                __m512bh w[4];                             // pairs 2c, 2c + 1 of both panels
                chunk_pairs(rec, q->kind, c, q->table, q->high, w);
                for (int j = 0; j < 4; j++)
                    _mm512_store_si512((void *)(out + ((j % 2) * kk_n + 2 * c + j / 2) * 32),
                                       dequant_pair((__m512i)w[j], shift, sc[j % 2], mn[j % 2], interleave));
            }
            continue;
        }
        expand(rec, q->kind, q->bkk, q->table, q->high, buf);
        for (int p = 0; p < 2; p++)
            for (int kk = 0; kk < q->bkk; kk++)
                _mm512_store_si512((void *)(out + (p * kk_n + kk) * 32),
                                   dequant_pair((__m512i)buf[2 * kk + p], shift, sc[p], mn[p], interleave));
    }
}

// The columns' factors a wide kernel applies to its sums: those of exact weights (dequant_unit leaves them out of
// the panels), else none.
static inline const float *wide_cols(const qdesc *q) {
    return q->exact ? q->cols : NULL;
}

// A kernel file's two entry points around its static run(): bf16 output, with the call of rows_gemm_bf16.c so the
// fused decoder takes it, and fp32 output (not rounded).
#define QGEMM_ENTRY_POINTS(bf16_name, f32_name)                                                                   \
    void bf16_name(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, const int64_t *desc,                     \
                   const uint16_t *bias, int64_t n, uint16_t *y, int64_t ldy, int threads) {                      \
        (void)k;                                                                                                  \
        if (m > 0)                                                                                                \
            run(x, m, ldx, desc, bias, n, y, ldy, threads, 0);                                                    \
    }                                                                                                             \
    void f32_name(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, const int64_t *desc,                      \
                  const uint16_t *bias, int64_t n, float *y, int64_t ldy, int threads) {                          \
        (void)k;                                                                                                  \
        if (m > 0)                                                                                                \
            run(x, m, ldx, desc, bias, n, y, ldy, threads, 1);                                                    \
    }
#endif
