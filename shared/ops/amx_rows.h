// The AMX rows kernel's tile loop over bf16 panels, shared by rows_gemm_amx.c (prepacked panels) and
// qgemm_amx_wide.c (panels dequantised from packed codes). A panel holds, for each pair of input features
// (2kk, 2kk + 1), 16 output columns' two weights side by side, 64 bytes a pair: sixteen consecutive pairs are one
// AMX B tile as they lie, and 32 input features of 16 rows of x one A tile.
#ifndef UPESI_AMX_ROWS_H
#define UPESI_AMX_ROWS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"

// Tiles 0-3: accumulators (C[row block][panel]) and 4-5: x blocks, `rows` rows each; 6-7: panels, 16 pairs of
// input features. Every row 64 bytes.
static inline void amx_rows_configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = (uint8_t)(i < 6 ? rows : 16);
    }
    _tile_loadconfig(&c);
}

// acc [rows, 16] fp32 (times the columns' factors cols [16] when not NULL, + bias) -> y rows, columns < left,
// rounded to bf16 as vcvtneps2bf16 does.
static inline void amx_rows_store(const float *acc, int rows, const float *cols, const uint16_t *bias, uint16_t *y,
                                  int64_t ldy, int64_t left) {
    if (left <= 0)
        return;
    __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias)), 16));
    __m512 f = cols ? _mm512_maskz_loadu_ps(m, cols) : _mm512_set1_ps(1.0f);
    for (int r = 0; r < rows; r++) {
        __m512 a = _mm512_loadu_ps(acc + 16 * r);
        if (cols)                                          // factor and bias in fp32, then rounded once
            a = _mm512_fmadd_ps(a, f, b);
        else if (bias)
            a = _mm512_add_ps(a, b);
        _mm256_mask_storeu_epi16((void *)(y + r * ldy), m, (__m256i)_mm512_cvtneps_pbh(a));
    }
}

// One step of 32 features: the two panels' B tiles (w0, w1: 16 pairs each, 64 bytes a pair) times those features of
// one or two blocks of 16 rows of x (x0, and x1 when `two`), added to the accumulators (tmm0-1, and tmm2-3).
static inline __attribute__((always_inline)) void amx_rows_step(const uint16_t *x0, const uint16_t *x1, int64_t ldx,
                                                                int two, const void *w0, const void *w1) {
    _tile_loadd(6, w0, 64);
    _tile_loadd(7, w1, 64);
    _tile_loadd(4, x0, ldx * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
        _tile_loadd(5, x1, ldx * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

// The accumulators -> acc [4][16 x 16] fp32 (C[block][panel]; the second block's only when `two`).
static inline void amx_rows_save(int two, float (*acc)[16 * 16]) {
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    if (two) {
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
    }
}

// One or two blocks of 16 rows of x (x0, and x1 when `two`) over two panels (w0, w1) of KK pairs: acc [4][16 x 16]
// fp32 = C[block][panel], each the same tile steps over K in 32 features. `prefetch`: ask for the next step's panel
// lines while the tile unit works (panels that were just written, in cache; a constant at each call).
static inline __attribute__((always_inline)) void amx_rows_tiles(const uint16_t *x0, const uint16_t *x1,
                                                                 int64_t ldx, int two, const uint16_t *w0,
                                                                 const uint16_t *w1, int64_t kk_n, int prefetch,
                                                                 float (*acc)[16 * 16]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kk_n; kb += 16) {
        for (int l = 0; prefetch && l < 16; l++) {
            _mm_prefetch((const char *)(w0 + (kb + 16) * 32 + 32 * l), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (kb + 16) * 32 + 32 * l), _MM_HINT_T0);
        }
        amx_rows_step(x0 + 2 * kb, x1 + 2 * kb, ldx, two, w0 + kb * 32, w1 + kb * 32);
    }
    amx_rows_save(two, acc);
}
#endif
