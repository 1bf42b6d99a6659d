// bf16 linear layers for a step's rows on CPUs with AMX (shared/ops/rows_gemm_amx.py loads this).
//
// The same call and the same weight panels as rows_gemm_bf16.c: panel p holds, for each pair of input features
// (2kk, 2kk + 1), 16 output columns' two weights side by side, 64 bytes a pair. Sixteen consecutive pairs of a
// panel are therefore one AMX B tile as it is (16 rows of 64 bytes), and 32 input features of 16 rows of x one A
// tile. Per pair of panels and per 32 rows, four fp32 accumulator tiles (2 row blocks x 2 panels) run over K in
// steps of 32 features with tdpbf16ps, so the weights stream from memory once per call while up to 32 rows share
// each tile of them (a second group of 32 rows rereads the pair's panels from cache).
//
// Every output is the same sequence of tile steps over K whatever the other rows of the call are: a row's result
// does not depend on how many rows share the call or where it sits among them. Rows past M in the last block are
// zeros (a padded copy of x when M is not a multiple of 16 above 16 rows; below, the tiles have M rows).
// K must be a multiple of 32 here; other K go to the fallback kernel given to upesi_amx_setup (rows_gemm_bf16.c).
// Shapes: M = rows, K = in features, N = out features (a multiple of 64 after padding), KK = K / 2.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_rows.h"

typedef void (*gemm_fn)(const uint16_t *, int64_t, int64_t, int64_t, const uint16_t *, const uint16_t *, int64_t,
                        uint16_t *, int64_t, int);

static gemm_fn fallback;

// Asks the kernel for the AMX tile state (once per process) and records the kernel for K not a multiple of 32.
// Returns 0 when AMX may be used.
int upesi_amx_setup(gemm_fn fb) {
    fallback = fb;
    return amx_request();
}

// x [M, K] bf16 rows (ldx apart), panels [NP, KK, 32] bf16 (NP a multiple of 4), bias [N] bf16 or NULL,
// y [M, N] bf16 (ldy apart).
void upesi_rows_gemm_amx(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, const uint16_t *panels,
                         const uint16_t *bias, int64_t n, uint16_t *y, int64_t ldy, int threads) {
    if (k % 32 || m <= 0) {
        if (m > 0)
            fallback(x, m, ldx, k, panels, bias, n, y, ldy, threads);
        return;
    }
    int64_t kk_n = k / 2, np = (n + 15) / 16, pairs = (np + 1) / 2, panel_stride = kk_n * 32;
    int64_t blocks = (m + 15) / 16;
    int rows = m < 16 ? (int)m : 16;
    uint16_t *pad = 0;
    if (m > 16 && m % 16) {                                // the last block's missing rows as zeros
        pad = calloc((size_t)(blocks * 16 * k), sizeof(uint16_t));
        for (int64_t r = 0; r < m; r++)
            memcpy(pad + r * k, x + r * ldx, (size_t)k * sizeof(uint16_t));
        x = pad;
        ldx = k;
    }
    #pragma omp parallel num_threads(threads) if (threads > 1 && pairs > 1)
    {
        float acc[4][16 * 16];
        amx_rows_configure(rows);
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < pairs; q++) {
            const uint16_t *w0 = panels + 2 * q * panel_stride, *w1 = w0 + panel_stride;
            for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
                int two = b0 + 1 < blocks;
                const uint16_t *x0 = x + b0 * 16 * ldx, *x1 = x0 + 16 * ldx;
                amx_rows_tiles(x0, x1, ldx, two, w0, w1, kk_n, 0, acc);
                for (int i = 0; i < 2 + 2 * two; i++) {
                    int64_t r0 = (b0 + i / 2) * 16, c0 = (2 * q + i % 2) * 16;
                    int valid = (int)(m - r0 < 16 ? m - r0 : 16);
                    amx_rows_store(acc[i], valid, NULL, bias ? bias + c0 : 0, y + r0 * ldy + c0, ldy, n - c0);
                }
            }
        }
        _tile_release();
    }
    free(pad);
}
