// bf16 linear layers for a step's few rows on CPUs with AVX512-BF16 (shared/ops/rows_gemm_bf16.py loads this).
//
// y [M, N] = x [M, K] @ W^T, W [N, K] prepacked in panels of 16 output columns: panel p holds, for each pair of
// input features (2kk, 2kk + 1), the 16 columns' two weights side by side (32 bf16 = one zmm register), which is
// what vdpbf16ps multiplies with a broadcast pair of x. A tile is 4 panels (64 columns) by up to 6 rows: 24 fp32
// accumulators, each weight register used by every row of the tile, so the weights stream from memory once per
// call while the rows stay in registers. Every output is a fixed sequence of dpbf16 steps over kk, so a row's
// result does not depend on how many rows share the call or where it sits among them.
// Shapes: M = rows, K = in features (even), N = out features (a multiple of 64 after padding), KK = K / 2.
#include <immintrin.h>
#include <stdint.h>

#define TP 4      // panels per tile
#define MR 6      // rows per tile

static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx, int mr, int64_t kk_n,
                                                       const uint16_t *w, int64_t panel_stride, const uint16_t *bias,
                                                       uint16_t *y, int64_t ldy, int64_t n_left) {
    __m512 acc[MR][TP];
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < TP; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < kk_n; kk++) {
        __m512bh wv[TP];
        for (int p = 0; p < TP; p++)
            wv[p] = (__m512bh)_mm512_loadu_si512((const void *)(w + p * panel_stride + kk * 32));
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + r * ldx + 2 * kk));
                for (int p = 0; p < TP; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < TP; p++) {
            int64_t left = n_left - p * 16;
            if (left <= 0) break;
            __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            __m512 a = acc[r][p];
            if (bias)                                      // added in fp32, then rounded once
                a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                        _mm256_maskz_loadu_epi16(m, (const void *)(bias + p * 16))), 16)));
            __m256i v = (__m256i)_mm512_cvtneps_pbh(a);
            _mm256_mask_storeu_epi16((void *)(y + r * ldy + p * 16), m, v);
        }
}

// x [M, K] bf16 rows (ldx apart), panels [NP, KK, 32] bf16 (NP a multiple of TP), bias [N] bf16 or NULL,
// y [M, N] bf16 (ldy apart).
void upesi_rows_gemm_bf16(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, const uint16_t *panels,
                          const uint16_t *bias, int64_t n, uint16_t *y, int64_t ldy, int threads) {
    int64_t kk_n = k / 2, np = (n + 15) / 16, tiles = (np + TP - 1) / TP;
    int64_t panel_stride = kk_n * 32;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const uint16_t *w = panels + t * TP * panel_stride;
        for (int64_t r0 = 0; r0 < m; r0 += MR) {
            int mr = (int)(m - r0 < MR ? m - r0 : MR);
            const uint16_t *xr = x + r0 * ldx;
            uint16_t *yr = y + r0 * ldy + t * TP * 16;
            const uint16_t *b = bias ? bias + t * TP * 16 : 0;
            int64_t left = n - t * TP * 16;
            switch (mr) {                                  // constant row counts: the accumulators stay in registers
                case 1: tile(xr, ldx, 1, kk_n, w, panel_stride, b, yr, ldy, left); break;
                case 2: tile(xr, ldx, 2, kk_n, w, panel_stride, b, yr, ldy, left); break;
                case 3: tile(xr, ldx, 3, kk_n, w, panel_stride, b, yr, ldy, left); break;
                case 4: tile(xr, ldx, 4, kk_n, w, panel_stride, b, yr, ldy, left); break;
                case 5: tile(xr, ldx, 5, kk_n, w, panel_stride, b, yr, ldy, left); break;
                default: tile(xr, ldx, 6, kk_n, w, panel_stride, b, yr, ldy, left); break;
            }
        }
    }
}
