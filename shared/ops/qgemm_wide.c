// A prefill chunk's rows through block-quantised weights on CPUs with AVX512-BF16 and no AMX (shared/ops/qgemm.py
// loads this for bf16 calls of WIDE_ROWS rows or more): the weight dequantised to bf16 and multiplied, fused.
//
// As qgemm_amx_wide.c does on AMX: per unit of 32 output columns, every block's codes are dequantised (qgemm.h's
// dequant_unit: w = (e - shift) * scale + min, rounded once to bf16) into two panels of rows_gemm_bf16.c's layout, a
// group of units at a time, which stay in the core's cache; then every row runs over the group's panels in tiles of
// 6 rows by 4 panels (24 fp32 accumulators, one vdpbf16ps per accumulator and pair of features), as rows_gemm_bf16.c
// runs over prepacked panels. A call reads the packed codes once and writes no dequantised weight to memory,
// against dequantising the whole weight and a bf16 matmul reading it back.
// The result is a bf16 copy of the weight's rows result up to the order of fp32 sums: every row the same steps over
// K, whatever the other rows of the call are. Exact weights (NVFP4 with fp8 scales) are not rounded: their panels
// hold e * scale and the columns' factors apply at the store.
// Shapes: M = rows, K = in features (even), N = out features, KK = K / 2, BKK = pairs per block.
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"

#define WMR 6     // rows per tile
#define WTP 4     // panels per tile (two units)

// Rows x [mr, K] over 4 panels (pan: each panel KK pairs of 32 bf16, `stride` bf16 apart) -> y's 64 columns from
// c0 (those below n), bf16: times the columns' factors cols [N'] when not NULL, plus bias (in fp32, then rounded
// once).
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx, int mr, int64_t kk_n,
                                                       const uint16_t *pan, int64_t stride, const float *cols,
                                                       const uint16_t *bias, int64_t n, int64_t c0, uint16_t *y,
                                                       int64_t ldy) {
    __m512 acc[WMR][WTP];
    for (int r = 0; r < WMR; r++)
        for (int p = 0; p < WTP; p++)
            acc[r][p] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < kk_n; kk++) {
        __m512bh wv[WTP];
        for (int p = 0; p < WTP; p++)
            wv[p] = (__m512bh)_mm512_load_si512((const void *)(pan + p * stride + kk * 32));
        for (int r = 0; r < WMR; r++) {
            if (r < mr) {
                __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + r * ldx + 2 * kk));
                for (int p = 0; p < WTP; p++)
                    acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
            }
        }
    }
    for (int p = 0; p < WTP; p++) {
        int64_t left = n - c0 - 16 * p;
        if (left <= 0)
            break;
        __mmask16 msk = lanes_below(left);
        __m512 bv = bias16(bias, c0 + 16 * p, msk);
        __m512 f = cols ? _mm512_maskz_loadu_ps(msk, cols + c0 + 16 * p) : _mm512_set1_ps(1.0f);
        for (int r = 0; r < mr; r++)
            _mm256_mask_storeu_epi16(y + r * ldy + c0 + 16 * p, msk,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[r][p], f, bv)));
    }
}

// Every row over the panels of `units` consecutive units (pan: each unit's two panels, 64 KK bf16 apart; an odd
// last unit's pair completed by a zero unit) -> y's columns from c0.
static void rows_over_units(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *pan, int units, int64_t kk_n,
                            const float *cols, const uint16_t *bias, int64_t n, int64_t c0, uint16_t *y,
                            int64_t ldy) {
    for (int64_t r0 = 0; r0 < m; r0 += WMR) {
        int mr = (int)(m - r0 < WMR ? m - r0 : WMR);
        const uint16_t *xr = x + r0 * ldx;
        uint16_t *yr = y + r0 * ldy;
        for (int u = 0; u < units; u += 2) {
            const uint16_t *w = pan + u * 64 * kk_n;
            int64_t c = c0 + u * UNIT;
            switch (mr) {                                  // constant row counts: the accumulators stay in registers
                case 1: tile(xr, ldx, 1, kk_n, w, 32 * kk_n, cols, bias, n, c, yr, ldy); break;
                case 2: tile(xr, ldx, 2, kk_n, w, 32 * kk_n, cols, bias, n, c, yr, ldy); break;
                case 3: tile(xr, ldx, 3, kk_n, w, 32 * kk_n, cols, bias, n, c, yr, ldy); break;
                case 4: tile(xr, ldx, 4, kk_n, w, 32 * kk_n, cols, bias, n, c, yr, ldy); break;
                case 5: tile(xr, ldx, 5, kk_n, w, 32 * kk_n, cols, bias, n, c, yr, ldy); break;
                default: tile(xr, ldx, WMR, kk_n, w, 32 * kk_n, cols, bias, n, c, yr, ldy); break;
            }
        }
    }
}

// x [M, K] bf16 rows (ldx apart), desc: the packed weight [N, K], bias [N] bf16 or NULL -> y [M, N] bf16 (ldy
// apart).
void upesi_qgemm_wide(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, const int64_t *desc,
                      const uint16_t *bias, int64_t n, uint16_t *y, int64_t ldy, int threads) {
    qdesc q = read_desc(desc);
    int64_t units = (n + UNIT - 1) / UNIT, pairs = (units + 1) / 2, kk_n = k / 2;
    // unit pairs a thread dequantises at a time: their panels (128 KK bf16 each) within about 512 KB of cache
    int64_t group = (512 << 10) / (256 * kk_n);
    group = group < 1 ? 1 : group;
    #pragma omp parallel num_threads(threads) if (threads > 1 && pairs > 1)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t p0 = pairs * t / nt, p1 = pairs * (t + 1) / nt;             // each thread its own columns
        uint16_t *pan = aligned_alloc(64, sizeof(uint16_t) * 128 * (size_t)(kk_n * group));
        for (int64_t g0 = p0; g0 < p1; g0 += group) {
            int gn = (int)(p1 - g0 < group ? p1 - g0 : group), un = 0;
            for (int i = 0; i < 2 * gn; i++) {
                int64_t u = 2 * g0 + i;
                if (u < units) {
                    dequant_unit(&q, q.data + u * q.nb * q.record, u, pan + i * 64 * kk_n, kk_n);
                    un++;
                } else {
                    memset(pan + i * 64 * kk_n, 0, sizeof(uint16_t) * 64 * (size_t)kk_n);
                }
            }
            rows_over_units(x, m, ldx, pan, (un + 1) / 2 * 2, kk_n, wide_cols(&q), bias, n, 2 * g0 * UNIT, y,
                            ldy);
        }
        free(pan);
    }
}
