// Linear layers whose weights stay block-quantised (4- or 8-bit codes with per-block scales), for a step's rows on
// CPUs with AVX512-BF16 (shared/ops/qgemm.py packs the weights and loads this).
//
// Every format this serves (NVFP4, GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K) is, per block of 16 or 32 input
// features of one output column, w = value(code) * scale + min. The kernel expands each code in registers to a bf16
// number e = value * f + shift (f is 1 or 2; shift a per-weight constant that makes e a small positive integer plus
// a power of two, so e is built from the code's bits with shifts and masks, no conversion), and computes per block
//     y[c] += scale'[c, b] * (sum_{i in b} e(code[c, i]) * x[i] - shift * sx[b])                 (no mins)
//     y[c] += scale'[c, b] * sum_{i in b} e(code[c, i]) * x[i]  +  min'[c, b] * sx[b]             (mins)
// where sx[b] = sum_{i in b} x[i], scale' = scale / f and min' = min - shift * scale' (the shift's correction
// joins the min: one multiply-add less per row and block). Every product e * x is exact in fp32 (x in bf16), the
// sums are in fp32: the dequantised weight's result up to the order (and the shift's cancellation) of fp32 sums.
//
// Weights are repacked once at load in units of 32 output columns (two panels of 16), one record per block:
//     codes   BKK pairs of features for both panels, in the order the expansion reads them (see expand)
//     scales  [2][16] fp16 or fp32, then mins [2][16] (when the format has them)
// A block's codes are expanded to the layout vdpbf16ps multiplies (pairs of features of 16 columns, one zmm) into
// a small buffer, up to MR rows of x at a time run over it, and each row's block sum is scaled into its fp32 total.
// Every output is the same sequence of steps whatever the other rows of the call are, so a verification row is
// computed exactly as a decode row.
// Shapes: M = rows, K = in features, N = out features (padded to a multiple of 32), BKK = feature pairs per block,
// NB = K / (2 BKK) blocks.
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"

#define MR 6      // rows per register tile: a 5-node draft tree's verification (6 rows) is one tile
#define P 2       // accumulators per row and panel: MR x 2 panels x P = 24 independent vdpbf16ps chains
#define REGS_ROWS5 12  // calls of up to this many rows expand kind 5's codes in registers for every tile of rows,
#define REGS_ROWS4 6   // kind 4's (table look-ups, dearer) for one tile; more rows expand once into a buffer
#define REGS_ROWS7 12  // kind 7's (bytes: two unpacks a pair); kind 8's conversions stay in the buffer

// A block's scales and mins for the kernel's sums: with mins, min' = min - shift * scale' (see the top).
static inline void kernel_scales(const qdesc *q, const uint8_t *rec, __m512 *sc, __m512 *mn) {
    block_scales(q, rec, sc, mn);
    if (q->has_min && q->shift != 0.f) {
        __m512 shift = _mm512_set1_ps(q->shift);
        mn[0] = _mm512_fnmadd_ps(shift, sc[0], mn[0]);
        mn[1] = _mm512_fnmadd_ps(shift, sc[1], mn[1]);
    }
}

// The shift's correction a block's sum takes itself: none when it is 0 or has joined the mins.
static inline int own_shift(const qdesc *q) {
    return q->shift != 0.f && !q->has_min;
}

// A block's sums a [rows][2 panels][P] of rows r0 .. r0 + mr into their totals: tot [rows][32] += scale * (x . e -
// shift * sx) (no mins; `sub`: shift is not 0), or scale * x . e + min' * sx (mins).
static inline __attribute__((always_inline)) void block_totals(__m512 (*a)[2][P], int mr, const __m512 *sc,
                                                               const __m512 *mn, int has_min, int sub, float shift,
                                                               const float *sx, int64_t nb, float *tot) {
    for (int r = 0; r < mr; r++) {
        __m512 s = _mm512_set1_ps(sx[r * nb]), corr = _mm512_set1_ps(shift * sx[r * nb]);
        for (int p = 0; p < 2; p++) {
            __m512 sum = _mm512_add_ps(a[r][p][0], a[r][p][1]);
            if (sub)
                sum = _mm512_sub_ps(sum, corr);
            __m512 t = _mm512_fmadd_ps(sum, sc[p], _mm512_loadu_ps(tot + UNIT * r + 16 * p));
            if (has_min)
                t = _mm512_fmadd_ps(mn[p], s, t);
            _mm512_storeu_ps(tot + UNIT * r + 16 * p, t);
        }
    }
}

// Rows r0 .. r0 + mr of one block from its expanded codes in buf (block_totals has the arithmetic).
static inline __attribute__((always_inline)) void rows_block(const uint16_t *x, int64_t ldx, int mr, int bkk,
                                                             const __m512bh *buf, const __m512 *sc, const __m512 *mn,
                                                             int has_min, int sub, float shift, const float *sx,
                                                             int64_t nb, float *tot) {
    __m512 a[MR][2][P];
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < 2; p++)
            for (int j = 0; j < P; j++)
                a[r][p][j] = _mm512_setzero_ps();
    for (int kk = 0; kk < bkk; kk += P)
        for (int j = 0; j < P; j++) {
            __m512bh w0 = buf[2 * (kk + j)], w1 = buf[2 * (kk + j) + 1];
            for (int r = 0; r < MR; r++) {
                if (r < mr) {
                    __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + r * ldx + 2 * (kk + j)));
                    a[r][0][j] = _mm512_dpbf16_ps(a[r][0][j], xv, w0);
                    a[r][1][j] = _mm512_dpbf16_ps(a[r][1][j], xv, w1);
                }
            }
        }
    block_totals(a, mr, sc, mn, has_min, sub, shift, sx, nb, tot);
}

// One row (a decode): a block's codes expanded in registers and multiplied at once, the unit's totals in registers;
// the same accumulators and order of sums as rows_block, so the result equals a row of a wider call bit for bit.
static inline __attribute__((always_inline)) void row1_chunk(const __m512bh *w, const uint16_t *x, int c,
                                                             __m512 (*a)[P]) {
    __m512bh x0 = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + 4 * c));
    __m512bh x1 = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + 4 * c + 2));
    a[0][0] = _mm512_dpbf16_ps(a[0][0], x0, w[0]);
    a[1][0] = _mm512_dpbf16_ps(a[1][0], x0, w[1]);
    a[0][1] = _mm512_dpbf16_ps(a[0][1], x1, w[2]);
    a[1][1] = _mm512_dpbf16_ps(a[1][1], x1, w[3]);
}

static void run_row(const uint16_t *x, const qdesc *qd, const uint16_t *bias, int64_t n, void *y, int threads,
                    int out_f32) {
    qdesc q = *qd;
    int64_t units = (n + UNIT - 1) / UNIT, bf = 2 * q.bkk;
    float *sx = block_sums(x, 1, bf * q.nb, q.nb, bf);
    int sub = own_shift(&q);
    #pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        __attribute__((aligned(64))) float tot[UNIT];
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
            const uint8_t *rec = q.data + u * q.nb * q.record;
            for (int64_t b = 0; b < q.nb; b++, rec += q.record) {
                __m512 sc[2], mn[2], a[2][P];
                prefetch_ahead(rec, q.record);
                for (int p = 0; p < 2; p++)
                    a[p][0] = a[p][1] = _mm512_setzero_ps();
                const uint16_t *xb = x + b * bf;
                if (q.kind == 5 || q.kind == 4) {                  // expanded in registers
                    for (int c = 0; c < q.bkk / 2; c++) {
                        __m512bh w[4];
                        chunk_pairs(rec, q.kind, c, q.table, q.high, w);
                        row1_chunk(w, xb, c, a);
                    }
                } else {
                    __m512bh buf[32];
                    expand(rec, q.kind, q.bkk, q.table, q.high, buf);
                    for (int c = 0; c < q.bkk / 2; c++)
                        row1_chunk(buf + 4 * c, xb, c, a);
                }
                kernel_scales(&q, rec, sc, mn);
                __m512 corr = _mm512_set1_ps(q.shift * sx[b]), s = _mm512_set1_ps(sx[b]);
                __m512 s0 = _mm512_add_ps(a[0][0], a[0][1]), s1 = _mm512_add_ps(a[1][0], a[1][1]);
                if (sub) {
                    s0 = _mm512_sub_ps(s0, corr);
                    s1 = _mm512_sub_ps(s1, corr);
                }
                t0 = _mm512_fmadd_ps(s0, sc[0], t0);
                t1 = _mm512_fmadd_ps(s1, sc[1], t1);
                if (q.has_min) {
                    t0 = _mm512_fmadd_ps(mn[0], s, t0);
                    t1 = _mm512_fmadd_ps(mn[1], s, t1);
                }
            }
            _mm512_store_ps(tot, t0);
            _mm512_store_ps(tot + 16, t1);
            store_unit(tot, 1, q.cols, bias, n, u * UNIT, y, 0, out_f32);
        }
    }
    free(sx);
}

// Rows r0 .. r0 + mr of one block of kind 5, 4 or 7, its codes expanded in registers a chunk at a time (as run_row
// does) instead of into a buffer: a verification's few rows skip the buffer's stores and loads. The accumulators
// and order of sums of rows_block, so every row equals a decode row bit for bit.
static inline __attribute__((always_inline)) void rows_block_regs(const uint16_t *x, int64_t ldx, int mr,
                                                                  const qdesc *q, const uint8_t *rec,
                                                                  const __m512 *sc, const __m512 *mn, int sub,
                                                                  const float *sx, float *tot) {
    __m512 a[MR][2][P];
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < 2; p++)
            for (int j = 0; j < P; j++)
                a[r][p][j] = _mm512_setzero_ps();
    for (int c = 0; c < q->bkk / 2; c++) {
        __m512bh w[4];
        chunk_pairs(rec, q->kind, c, q->table, q->high, w);
        for (int r = 0; r < MR; r++)
            if (r < mr)
                row1_chunk(w, x + r * ldx, c, a[r]);
    }
    block_totals(a, mr, sc, mn, q->has_min, sub, q->shift, sx, q->nb, tot);
}

static void run(const uint16_t *x, int64_t m, int64_t ldx, const int64_t *desc, const uint16_t *bias, int64_t n,
                void *y, int64_t ldy, int threads, int out_f32) {
    qdesc q = read_desc(desc);
    if (m == 1) {
        run_row(x, &q, bias, n, y, threads, out_f32);
        return;
    }
    int regs = (q.kind == 5 && m <= REGS_ROWS5) || (q.kind == 4 && m <= REGS_ROWS4)
               || (q.kind == 7 && m <= REGS_ROWS7);
    int64_t units = (n + UNIT - 1) / UNIT, bf = 2 * q.bkk;
    int64_t tiles = (m + MR - 1) / MR, base = m / tiles, extra = m % tiles;   // tiles of base or base + 1 rows
    int sub = own_shift(&q);
    float *sx = malloc(sizeof(float) * (size_t)(m * q.nb));                   // [M, NB] block sums of x
    #pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        __m512bh buf[32];
        float *tot = aligned_alloc(64, sizeof(float) * UNIT * (size_t)((m + MR - 1) / MR * MR));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            row_block_sums(x + r * ldx, q.nb, bf, sx + r * q.nb);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            memset(tot, 0, sizeof(float) * UNIT * (size_t)m);
            const uint8_t *rec = q.data + u * q.nb * q.record;
            for (int64_t b = 0; b < q.nb; b++, rec += q.record) {
                __m512 sc[2], mn[2];
                prefetch_ahead(rec, q.record);
                if (!regs)
                    expand(rec, q.kind, q.bkk, q.table, q.high, buf);
                kernel_scales(&q, rec, sc, mn);
                for (int64_t t = 0, r0 = 0; t < tiles; t++) {
                    int mr = (int)(base + (t < extra));
                    const uint16_t *xr = x + r0 * ldx + b * bf;
                    const float *sxr = sx + r0 * q.nb + b;
                    float *tr = tot + UNIT * r0;
                    // a constant row count per call: the accumulators stay in registers
                    #define ROWS(R) (regs ? rows_block_regs(xr, ldx, R, &q, rec, sc, mn, sub, sxr, tr) \
                                      : rows_block(xr, ldx, R, q.bkk, buf, sc, mn, q.has_min, sub, q.shift, sxr, \
                                                   q.nb, tr))
                    switch (mr) {
                        case 1: ROWS(1); break;
                        case 2: ROWS(2); break;
                        case 3: ROWS(3); break;
                        case 4: ROWS(4); break;
                        case 5: ROWS(5); break;
                        default: ROWS(MR);
                    }
                    #undef ROWS
                    r0 += mr;
                }
            }
            store_unit(tot, m, q.cols, bias, n, u * UNIT, y, ldy, out_f32);
        }
        free(tot);
    }
    free(sx);
}

// x [M, K] bf16 rows (ldx apart), desc: the packed weight [N, K], bias [N] bf16 or NULL -> y [M, N] bf16 (ldy
// apart): upesi_qgemm; y fp32: upesi_qgemm_f32.
QGEMM_ENTRY_POINTS(upesi_qgemm, upesi_qgemm_f32)

// The weight dequantised, transposed: wt [K, N] bf16 (ldw apart), each w = (e - shift) * scale' + min computed in
// fp32 (one fused multiply-add; the columns' factors taken into scale' and min) and rounded once to bf16. For a
// prefill's many rows a bf16 matmul over it beats expanding the codes again for every few rows.
void upesi_qgemm_dequant(const int64_t *desc, int64_t n, uint16_t *wt, int64_t ldw, int threads) {
    qdesc q = read_desc(desc);
    int64_t units = (n + UNIT - 1) / UNIT, bf = 2 * q.bkk;
    const __m512i high_half = _mm512_set1_epi32((int32_t)0xFFFF0000);
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && units > 1)
    for (int64_t u = 0; u < units; u++) {
        __m512bh buf[32];
        const uint8_t *rec = q.data + u * q.nb * q.record;
        for (int64_t b = 0; b < q.nb; b++, rec += q.record) {
            __m512 sc[2], mn[2];
            expand(rec, q.kind, q.bkk, q.table, q.high, buf);
            dequant_scales(&q, rec, u, 1, sc, mn);
            for (int p = 0; p < 2; p++) {
                int64_t c0 = u * UNIT + 16 * p, left = n - c0;
                if (left <= 0)
                    break;
                __mmask16 msk = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
                __m512 shift = _mm512_set1_ps(q.shift);
                for (int kk = 0; kk < q.bkk; kk++) {
                    __m512i v = (__m512i)buf[2 * kk + p];        // lane c: features (2kk, 2kk + 1) of column c0 + c
                    __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                    __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
                    __m512 w0 = _mm512_fmadd_ps(_mm512_sub_ps(lo, shift), sc[p], mn[p]);
                    __m512 w1 = _mm512_fmadd_ps(_mm512_sub_ps(hi, shift), sc[p], mn[p]);
                    int64_t k = b * bf + 2 * kk;
                    _mm256_mask_storeu_epi16(wt + k * ldw + c0, msk, (__m256i)_mm512_cvtneps_pbh(w0));
                    _mm256_mask_storeu_epi16(wt + (k + 1) * ldw + c0, msk, (__m256i)_mm512_cvtneps_pbh(w1));
                }
            }
        }
    }
}
