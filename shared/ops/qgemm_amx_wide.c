// A prefill chunk's rows through block-quantised weights on CPUs with AMX (shared/ops/qgemm.py loads this for bf16
// calls of WIDE_ROWS rows or more): the weight dequantised to bf16 and multiplied on the tile unit, fused.
//
// Per unit of 32 output columns, the codes of every block (qgemm.h's expand) are dequantised as
// upesi_qgemm_dequant does (w = (e - shift) * scale + min in one fused multiply-add, rounded once to bf16) into two
// panels of rows_gemm_amx.c's layout ([KK pairs][16 columns][2 features] bf16, 64 bytes a pair), a few units at
// a time, which stay in the core's cache; the rows then run over them as rows_gemm_amx.c runs over prepacked
// panels: per 32 rows, four fp32 accumulator tiles over K in steps of 32 features, each 32 rows over every unit of
// the group while those rows are cached. So a call reads the packed codes once and never writes a dequantised
// weight to memory, against dequantising the whole weight and then a bf16 matmul reading it back.
// The result is a bf16 copy of the weight's rows result up to the order of fp32 sums: every row the same tile
// steps over K, whatever the other rows of the call are. Exact weights (NVFP4 with fp8 scales) are not rounded:
// their panels hold e * scale and the columns' factors apply at the store, so each row equals the same row through
// qgemm_amx.c's run_exact bit for bit.
// It runs where qgemm_amx.c does, whose setup has asked for the process's AMX tile state.
// Shapes: M = rows, K = in features (a multiple of 32), N = out features, KK = K / 2, BKK = pairs per block.
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "amx_rows.h"
#include "bf16_512.h"
#include "qgemm.h"

// All rows over the panels of `units` consecutive units (pan: each unit's two panels, 64 KK bf16 apart): y [M, 32
// columns a unit from c0] (columns < n), times the columns' factors cols [N'] when not NULL. Each pair of 16-row
// blocks of x runs over every unit while it is cached.
static void rows_over_units(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *pan, int units,
                            int64_t kk_n, const float *cols, const uint16_t *bias, int64_t n, int64_t c0, uint16_t *y,
                            int64_t ldy) {
    float acc[4][16 * 16];
    int64_t blocks = (m + 15) / 16;
    for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
        int two = b0 + 1 < blocks;
        const uint16_t *x0 = x + b0 * 16 * ldx, *x1 = x0 + 16 * ldx;
        for (int u = 0; u < units; u++) {
            const uint16_t *w0 = pan + u * 64 * kk_n, *w1 = w0 + kk_n * 32;
            amx_rows_tiles(x0, x1, ldx, two, w0, w1, kk_n, 1, acc);
            for (int i = 0; i < 2 + 2 * two; i++) {
                int64_t r0 = (b0 + i / 2) * 16, c = c0 + u * UNIT + (i % 2) * 16;
                int valid = (int)(m - r0 < 16 ? m - r0 : 16);
                amx_rows_store(acc[i], valid, cols ? cols + c : NULL, bias ? bias + c : 0, y + r0 * ldy + c, ldy,
                               n - c);
            }
        }
    }
}

// SwiGLU's activation of the gate and up columns of one unit pair for a pair of 16-row blocks: gate, up [32 rows][32
// columns] bf16 as the GEMM rounds them -> y's rows r0 .. r0 + rows, columns c .. c + 32 (< left): round(silu(gate)
// from the table * up), as decoder_bf16.c's upesi_silu_mul_bf16 computes it from the GEMM's output.
static void swiglu_store(const uint16_t *gate, const uint16_t *up, int rows, const uint16_t *silu, uint16_t *y,
                         int64_t ldy, int64_t left) {
    for (int half = 0; half < 2 && left - 16 * half > 0; half++) {
        __mmask16 m = lanes_below(left - 16 * half);
        for (int r = 0; r < rows; r++) {
            __m512i g = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, gate + 32 * r + 16 * half));
            __m512i a = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, g, (const int *)silu, 2);
            __m512 u = bf16x16_load(up + 32 * r + 16 * half, m);
            bf16x16_store(y + r * ldy + 16 * half, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), u), m);
        }
    }
}

// The rows over `pairs` unit pairs (pan: each pair's gate unit, then its up unit, 64 KK bf16 a unit): y [M, 32
// columns a pair from c0] = the activation of the gate columns c0 + .. and the up columns inter + c0 + ...
static void rows_over_pairs(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *pan, int pairs,
                            int64_t kk_n, const float *cols, const uint16_t *bias, int64_t inter, int64_t c0,
                            const uint16_t *silu, uint16_t *y, int64_t ldy) {
    float acc[4][16 * 16];
    uint16_t act[2][32 * 32];                              // gate, up: [32 rows][32 columns] bf16
    int64_t blocks = (m + 15) / 16;
    for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
        int two = b0 + 1 < blocks;
        const uint16_t *x0 = x + b0 * 16 * ldx, *x1 = x0 + 16 * ldx;
        int rows = (int)(m - b0 * 16 < 32 ? m - b0 * 16 : 32);
        for (int u = 0; u < pairs; u++) {
            int64_t c = c0 + u * UNIT;
            for (int h = 0; h < 2; h++) {                  // the gate unit, then the up unit
                const uint16_t *w0 = pan + (2 * u + h) * 64 * kk_n, *w1 = w0 + kk_n * 32;
                int64_t col = c + h * inter;
                amx_rows_tiles(x0, x1, ldx, two, w0, w1, kk_n, 1, acc);
                for (int i = 0; i < 2 + 2 * two; i++)
                    amx_rows_store(acc[i], 16, cols ? cols + col + (i % 2) * 16 : NULL,
                                   bias ? bias + col + (i % 2) * 16 : 0, act[h] + (i / 2) * 16 * 32 + (i % 2) * 16, 32,
                                   16);
            }
            swiglu_store(act[0], act[1], rows, silu, y + b0 * 16 * ldy + c, ldy, inter - c);
        }
    }
}

// x [M, K] bf16 rows (ldx apart, M >= 16), desc: a gate_up weight [2 I, K] (gate rows, then up rows; K and I
// multiples of 32), bias [2 I] bf16 or NULL, silu: decoder_bf16.c's table of round(silu(g)) by g's bits -> y [M, I]
// bf16 (ldy apart): silu(gate) * up, the same bits as this file's GEMM and then upesi_silu_mul_bf16, without
// writing the [M, 2 I] products.
void upesi_qgemm_amx_wide_swiglu(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, const int64_t *desc,
                                 const uint16_t *bias, int64_t inter, uint16_t *y, int64_t ldy, int threads,
                                 const uint16_t *silu) {
    qdesc q = read_desc(desc);
    int64_t pairs = inter / UNIT, kk_n = k / 2;
    uint16_t *pad = 0;
    if (m % 16) {
        pad = calloc((size_t)((m + 15) / 16 * 16 * k), sizeof(uint16_t));
        for (int64_t r = 0; r < m; r++)
            memcpy(pad + r * k, x + r * ldx, (size_t)k * sizeof(uint16_t));
        x = pad;
        ldx = k;
    }
    int64_t group = (512 << 10) / (256 * kk_n);            // unit pairs dequantised at a time (about 512 KB)
    group = group < 1 ? 1 : group;
    #pragma omp parallel num_threads(threads) if (threads > 1 && pairs > 1)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t p0 = pairs * t / nt, p1 = pairs * (t + 1) / nt;
        uint16_t *pan = aligned_alloc(64, sizeof(uint16_t) * 128 * (size_t)(kk_n * group));
        amx_rows_configure(16);
        for (int64_t g0 = p0; g0 < p1; g0 += group) {
            int gn = (int)(p1 - g0 < group ? p1 - g0 : group);
            for (int i = 0; i < 2 * gn; i++) {
                int64_t unit = g0 + i / 2 + (i % 2) * pairs;
                dequant_unit(&q, q.data + unit * q.nb * q.record, unit, pan + i * 64 * kk_n, kk_n);
            }
            rows_over_pairs(x, m, ldx, pan, gn, kk_n, wide_cols(&q), bias, inter, g0 * UNIT, silu, y, ldy);
        }
        free(pan);
        _tile_release();
    }
    free(pad);
}

// x [M, K] bf16 rows (ldx apart, M >= 16), desc: the packed weight [N, K] (K a multiple of 32), bias [N] bf16 or
// NULL -> y [M, N] bf16 (ldy apart).
void upesi_qgemm_amx_wide(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, const int64_t *desc,
                          const uint16_t *bias, int64_t n, uint16_t *y, int64_t ldy, int threads) {
    qdesc q = read_desc(desc);
    int64_t units = (n + UNIT - 1) / UNIT, kk_n = k / 2;
    uint16_t *pad = 0;
    if (m % 16) {                                          // the last block's missing rows as zeros
        pad = calloc((size_t)((m + 15) / 16 * 16 * k), sizeof(uint16_t));
        for (int64_t r = 0; r < m; r++)
            memcpy(pad + r * k, x + r * ldx, (size_t)k * sizeof(uint16_t));
        x = pad;
        ldx = k;
    }
    // units a thread dequantises at a time: their panels (64 KK bf16 each) within about 512 KB of cache
    int64_t group = (512 << 10) / (128 * kk_n);
    group = group < 1 ? 1 : group;
    #pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;             // each thread its own columns
        uint16_t *pan = aligned_alloc(64, sizeof(uint16_t) * 64 * (size_t)(kk_n * group));
        amx_rows_configure(16);
        for (int64_t g0 = u0; g0 < u1; g0 += group) {
            int gn = (int)(u1 - g0 < group ? u1 - g0 : group);
            for (int i = 0; i < gn; i++)
                dequant_unit(&q, q.data + (g0 + i) * q.nb * q.record, g0 + i, pan + i * 64 * kk_n, kk_n);
            rows_over_units(x, m, ldx, pan, gn, kk_n, wide_cols(&q), bias, n, g0 * UNIT, y, ldy);
        }
        free(pan);
        _tile_release();
    }
    free(pad);
}
