// Block-quantised linear layers on CPUs with AMX (shared/ops/qgemm.py loads this): the weights, descriptor and
// arithmetic of qgemm.c, with each block's products on the tile unit.
//
// A block's expanded codes (qgemm.h's expand: BKK pairs of features by 2 panels of 16 columns, 64 bytes each) are
// two AMX B tiles as they lie (BKK rows, 128 bytes apart), and a block of x's features for 16 rows one A tile. Per
// block and group of 16 rows, tdpbf16ps gives the block's sums for both panels, which are scaled into the rows'
// fp32 totals as qgemm.c does (scale * (sum - shift * sx) + min * sx). The AVX-512 work per row is then a few
// instructions per block instead of a dot product. Weights whose every e * scale is a bf16 number (NVFP4 with its
// fp8 scales) skip that per-block step: run_exact multiplies those products as bf16 weights over the whole of K.
//
// A row's result is the same whatever the other rows of the call are (rows past M in the last group are zeros of a
// padded copy of x), so a verification row is computed exactly as a decode row; the sums are in another order than
// qgemm.c's, so one machine uses one of the two kernels for every call.
// Shapes: M = rows, K = in features, N = out features, BKK = feature pairs per block, NB = blocks.
#include <stdlib.h>
#include <string.h>

#include "amx_rows.h"
#include "qgemm.h"

// Asks the kernel for the AMX tile state (once per process). Returns 0 when AMX may be used.
int upesi_qgemm_amx_setup(void) {
    return amx_request();
}

// Blocks go in pairs. Tiles 0-1 / 5-6: the sums of a pair's first / second block for the two panels [rows, 16]
// fp32; 2 / 7: x's features of those blocks [rows, 2 BKK] bf16; 3-4: a block's expanded codes, one panel each
// [BKK, 32] bf16, loaded for the first block and then the second.
static void configure(int rows, int bkk) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        int codes = t == 3 || t == 4, xs = t == 2 || t == 7;
        c.rows[t] = (uint8_t)(codes ? bkk : rows);
        c.colsb[t] = (uint16_t)(xs ? 4 * bkk : 64);
    }
    _tile_loadconfig(&c);
}

// A pair's sums (acc [4][rows][16]: first block's two panels, then the second's) into the rows' totals:
// tot += sc * sums + mn' * sx per block, mn' = mn - shift * sc.
// with_min = 0 (no mins and no shift: NVFP4) skips the min terms, which are then zero.
static inline void scale_pair(const float (*acc)[16 * 16], int two, int with_min, const __m512 *sc,
                              const __m512 *mn, const float *sx, int64_t nb, float *tot, int64_t r0, int64_t valid) {
    for (int64_t r = 0; r < valid; r++) {
        const float *s = sx + (r0 + r) * nb;
        __m512 s0 = _mm512_set1_ps(s[0]), s1 = two ? _mm512_set1_ps(s[1]) : _mm512_setzero_ps();
        for (int p = 0; p < 2; p++) {
            float *t = tot + UNIT * (r0 + r) + 16 * p;
            __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(acc[p] + 16 * r), sc[p], _mm512_loadu_ps(t));
            if (with_min)
                v = _mm512_fmadd_ps(mn[p], s0, v);
            if (two) {
                v = _mm512_fmadd_ps(_mm512_loadu_ps(acc[2 + p] + 16 * r), sc[2 + p], v);
                if (with_min)
                    v = _mm512_fmadd_ps(mn[2 + p], s1, v);
            }
            _mm512_storeu_ps(t, v);
        }
    }
}

// Blocks of 16 features (BKK 8) at one or two rows: the blocks go two to a step of 32 features, and G of them
// share the accumulator tiles, m tile rows per block (G = 16 / m, at most the blocks there are, rounded up to an
// even count). Step s's A tile holds, in row r * G + j, row r of x's features of block j of its group where step s
// multiplies that block, and zeros elsewhere (built once per call: it does not depend on the unit). A block's sums
// are then its own products added to exact zeros, as in run_pairs, and are scaled in the same order, while the tiles
// are stored once per group instead of once per pair of blocks.
#define STEP_FEATURES 32                                   // two blocks of 16: one A row of 64 bytes

// xa [steps][m * g rows][32] bf16: every step's A tile (calloc'd; the caller frees it).
static uint16_t *small_tiles(const uint16_t *x, int64_t m, int64_t ldx, int64_t nb, int g) {
    int64_t steps = (nb + 1) / 2, tile = m * g * STEP_FEATURES;
    uint16_t *xa = calloc((size_t)(steps * tile), sizeof(uint16_t));
    for (int64_t b = 0; b < nb; b++)
        for (int64_t r = 0; r < m; r++)
            memcpy(xa + b / 2 * tile + (r * g + b % g) * STEP_FEATURES + b % 2 * 16, x + r * ldx + b * 16,
                   16 * sizeof(uint16_t));
    return xa;
}

// Tiles 0-1: a group's sums for the two panels [m * g, 16] fp32; 2 / 5: a step's A tile (alternating steps);
// 3-4 / 6-7: the step's expanded codes, one panel each [16 pairs, 32] bf16 (alternating).
static void configure_small(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)(t == 3 || t == 4 || t == 6 || t == 7 ? 16 : rows);
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

// One step's products into the group's sums: A and B0 / B1 the step's tiles (steps alternate between two sets).
#define SMALL_STEP(A, B0, B1, xs, codes)                                                                          \
    do {                                                                                                          \
        _tile_loadd(A, (const void *)(xs), 2 * STEP_FEATURES);                                                    \
        _tile_loadd(B0, (const void *)(codes), 128);                                                              \
        _tile_loadd(B1, (const void *)((codes) + 1), 128);                                                        \
        _tile_dpbf16ps(0, A, B0);                                                                                 \
        _tile_dpbf16ps(1, A, B1);                                                                                 \
    } while (0)

static void run_small(const uint16_t *x, int64_t m, int64_t ldx, const qdesc *qd, const uint16_t *bias, int64_t n,
                      void *y, int64_t ldy, int threads, int out_f32) {
    qdesc q = *qd;
    int g = (int)(16 / m);
    if (g > q.nb)
        g = (int)(q.nb + 1) / 2 * 2;
    int64_t units = (n + UNIT - 1) / UNIT, tile = m * g * STEP_FEATURES;
    float *sx = block_sums(x, m, ldx, q.nb, 16);
    uint16_t *xa = small_tiles(x, m, ldx, q.nb, g);
    __m512 shift = _mm512_set1_ps(q.shift);
    int with_min = q.has_min || q.shift != 0.f;
    #pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        __m512bh bufs[2][32];                              // a step's expanded codes, alternating steps
        __m512 sc[16][2], mn[16][2];
        float acc[2][16 * 16];
        float tot[2 * UNIT];
        configure_small((int)m * g);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            memset(tot, 0, sizeof(float) * UNIT * (size_t)m);
            const uint8_t *unit = q.data + u * q.nb * q.record;
            for (int64_t b0 = 0; b0 < q.nb; b0 += g) {
                int nblk = q.nb - b0 < g ? (int)(q.nb - b0) : g;
                _tile_zero(0);
                _tile_zero(1);
                for (int s = 0; 2 * s < nblk; s++) {
                    __m512bh *buf = bufs[s & 1];
                    for (int i = 0; i < 2; i++) {
                        int j = 2 * s + i;
                        if (j >= nblk) {                           // an odd last block: zero codes beside it
                            memset(buf + 16 * i, 0, sizeof(__m512bh) * 16);
                            continue;
                        }
                        const uint8_t *rec = unit + (b0 + j) * q.record;
                        prefetch_ahead(rec, q.record);
                        expand(rec, q.kind, q.bkk, q.table, q.high, buf + 16 * i);
                        block_scales(&q, rec, sc[j], mn[j]);
                        for (int pn = 0; pn < 2; pn++)             // mn' = mn - shift * sc
                            mn[j][pn] = _mm512_fnmadd_ps(shift, sc[j][pn], mn[j][pn]);
                    }
                    const uint16_t *xs = xa + (b0 / 2 + s) * tile;
                    if (s & 1)
                        SMALL_STEP(5, 6, 7, xs, buf);
                    else
                        SMALL_STEP(2, 3, 4, xs, buf);
                }
                _tile_stored(0, acc[0], 64);
                _tile_stored(1, acc[1], 64);
                for (int64_t r = 0; r < m; r++)                    // the group's blocks in order, as run_pairs
                    for (int j = 0; j < nblk; j++) {
                        __m512 s0 = _mm512_set1_ps(sx[r * q.nb + b0 + j]);
                        for (int pn = 0; pn < 2; pn++) {
                            float *t = tot + UNIT * r + 16 * pn;
                            __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(acc[pn] + 16 * (r * g + j)), sc[j][pn],
                                                       _mm512_loadu_ps(t));
                            if (with_min)
                                v = _mm512_fmadd_ps(mn[j][pn], s0, v);
                            _mm512_storeu_ps(t, v);
                        }
                    }
            }
            store_unit(tot, m, q.cols, bias, n, u * UNIT, y, ldy, out_f32);
        }
        _tile_release();
    }
    free(xa);
    free(sx);
}
#undef SMALL_STEP

// Other calls: blocks in pairs, each group of 16 rows one A tile straight from x.
static void run_pairs(const uint16_t *x, int64_t m, int64_t ldx, const qdesc *qd, const uint16_t *bias, int64_t n,
                      void *y, int64_t ldy, int threads, int out_f32) {
    qdesc q = *qd;
    int64_t units = (n + UNIT - 1) / UNIT, bf = 2 * q.bkk, groups = (m + 15) / 16;
    int rows = m < 16 ? (int)m : 16;
    uint16_t *pad = 0;
    if (m > 16 && m % 16) {                                // the last group's missing rows as zeros
        pad = calloc((size_t)(groups * 16 * ldx), sizeof(uint16_t));
        for (int64_t r = 0; r < m; r++)
            memcpy(pad + r * ldx, x + r * ldx, (size_t)(q.nb * bf) * sizeof(uint16_t));
        x = pad;
    }
    float *sx = block_sums(x, m, ldx, q.nb, bf);
    __m512 shift = _mm512_set1_ps(q.shift);
    int with_min = q.has_min || q.shift != 0.f;
    #pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        __m512bh bufs[2][32];                              // the pair's expanded codes
        float acc[4][16 * 16];
        float *tot = aligned_alloc(64, sizeof(float) * UNIT * (size_t)m);
        configure(rows, q.bkk);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            memset(tot, 0, sizeof(float) * UNIT * (size_t)m);
            const uint8_t *rec = q.data + u * q.nb * q.record;
            for (int64_t b = 0; b < q.nb; b += 2) {
                int two = b + 1 < q.nb;
                __m512 sc[4], mn[4];
                for (int i = 0; i < 1 + two; i++, rec += q.record) {
                    prefetch_ahead(rec, q.record);
                    expand(rec, q.kind, q.bkk, q.table, q.high, bufs[i]);
                    block_scales(&q, rec, sc + 2 * i, mn + 2 * i);
                    for (int p = 0; p < 2; p++)                    // mn' = mn - shift * sc
                        mn[2 * i + p] = _mm512_fnmadd_ps(shift, sc[2 * i + p], mn[2 * i + p]);
                }
                for (int64_t g = 0; g < groups; g++) {
                    const uint16_t *xg = x + g * 16 * ldx + b * bf;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(2, (const void *)xg, ldx * 2);
                    _tile_loadd(3, (const void *)bufs[0], 128);
                    _tile_loadd(4, (const void *)(bufs[0] + 1), 128);
                    _tile_dpbf16ps(0, 2, 3);
                    _tile_dpbf16ps(1, 2, 4);
                    if (two) {
                        _tile_zero(5);
                        _tile_zero(6);
                        _tile_loadd(7, (const void *)(xg + bf), ldx * 2);
                        _tile_loadd(3, (const void *)bufs[1], 128);
                        _tile_loadd(4, (const void *)(bufs[1] + 1), 128);
                        _tile_dpbf16ps(5, 7, 3);
                        _tile_dpbf16ps(6, 7, 4);
                    }
                    _tile_stored(0, acc[0], 64);
                    _tile_stored(1, acc[1], 64);
                    if (two) {
                        _tile_stored(5, acc[2], 64);
                        _tile_stored(6, acc[3], 64);
                    }
                    int64_t r0 = g * 16, valid = m - r0 < 16 ? m - r0 : 16;
                    scale_pair((const float (*)[16 * 16])acc, two, with_min, sc, mn, sx + b, q.nb, tot, r0, valid);
                }
            }
            store_unit(tot, m, q.cols, bias, n, u * UNIT, y, ldy, out_f32);
        }
        free(tot);
        _tile_release();
    }
    free(sx);
    free(pad);
}

// Weights whose every e * scale is a bf16 number (desc's exact: NVFP4's E2M1 values times fp8 block scales): each
// block's expanded codes times its scales become the bf16 weights themselves, exactly, 32 features (two blocks of
// 16 or one of 32) a step into one of two alternating buffers, and the tiles sum over the whole of K, up to 32 rows
// at a time (four accumulator tiles); the columns' factors apply at the store. No block's sum is scaled on its
// own, so rows cost the tile unit's steps, not a vector epilogue per block and row. A row's sums are the same tile
// steps whatever the call's other rows, so every call on such a weight takes this path.
#define EXACT_ROWS 32

// Expanded pairs of one panel (lane c: features 2kk, 2kk + 1 of column c) times the column's scale, as bf16 pairs:
// each product is exact, so its fp32 bits end in 16 zeros and the two halves join without rounding.
static inline __m512i scaled_pairs(__m512i v, __m512 sc) {
    const __m512i high_half = _mm512_set1_epi32((int32_t)0xFFFF0000);
    __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), sc);
    __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high_half)), sc);
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(lo), 16), _mm512_castps_si512(hi),
                                     high_half, 0xF8);                     // lo >> 16 | (hi & high_half)
}

// x's rows padded where a tile would read past them: to 16-row groups when M > 16, to whole steps of 32 features
// when the blocks are odd (zeros). Returns the copy (calloc'd, the caller frees it) or NULL when x serves as is.
static uint16_t *exact_rows(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, int64_t *ld) {
    int64_t kp = (k + 31) / 32 * 32, mp = m > 16 ? (m + 15) / 16 * 16 : m;
    if (kp == k && mp == m)
        return NULL;
    uint16_t *pad = calloc((size_t)(mp * kp), sizeof(uint16_t));
    for (int64_t r = 0; r < m; r++)
        memcpy(pad + r * kp, x + r * ldx, (size_t)k * sizeof(uint16_t));
    *ld = kp;
    return pad;
}

static void run_exact(const uint16_t *x, int64_t m, int64_t ldx, const qdesc *qd, const uint16_t *bias, int64_t n,
                      void *y, int64_t ldy, int threads, int out_f32) {
    qdesc q = *qd;
    int64_t units = (n + UNIT - 1) / UNIT, kk_n = q.nb * q.bkk, per_step = 16 / q.bkk;    // blocks a step
    uint16_t *pad = exact_rows(x, m, ldx, 2 * kk_n, &ldx);
    if (pad)
        x = pad;
    #pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        __m512i buf[2][2][16];                             // a step's weights [panel][16 pairs], alternating steps
        float acc[4][16 * 16], tot[EXACT_ROWS * UNIT];
        amx_rows_configure(m < 16 ? (int)m : 16);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            for (int64_t r0 = 0; r0 < m; r0 += EXACT_ROWS) {
                int rows = (int)(m - r0 < EXACT_ROWS ? m - r0 : EXACT_ROWS), two = rows > 16;
                const uint16_t *x0 = x + r0 * ldx, *x1 = x0 + 16 * ldx;
                const uint8_t *rec = q.data + u * q.nb * q.record;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t b = 0, s = 0; b < q.nb; b += per_step, s ^= 1) {
                    for (int i = 0; i < per_step; i++, rec += q.record) {
                        if (b + i == q.nb) {                       // an odd last block: zero weights beside it
                            memset(buf[s][0] + 8, 0, sizeof(__m512i) * 8);
                            memset(buf[s][1] + 8, 0, sizeof(__m512i) * 8);
                            break;
                        }
                        __m512 sc[2], mn[2];
                        prefetch_ahead(rec, q.record);
                        block_scales(&q, rec, sc, mn);
                        for (int c = 0; c < q.bkk / 2; c++) {
                            __m512bh w[4];                         // pairs 2c, 2c + 1 of both panels
                            chunk_pairs(rec, q.kind, c, q.table, q.high, w);
                            for (int j = 0; j < 4; j++)
                                buf[s][j % 2][q.bkk * i + 2 * c + j / 2] = scaled_pairs((__m512i)w[j], sc[j % 2]);
                        }
                    }
                    amx_rows_step(x0 + 2 * q.bkk * b, x1 + 2 * q.bkk * b, ldx, two, buf[s][0], buf[s][1]);
                }
                amx_rows_save(two, acc);
                for (int r = 0; r < rows; r++)                     // acc [group][panel][16 rows][16] -> tot
                    for (int p = 0; p < 2; p++)
                        memcpy(tot + UNIT * r + 16 * p, acc[2 * (r / 16) + p] + 16 * (r % 16), 16 * sizeof(float));
                store_unit(tot, rows, q.cols, bias, n, u * UNIT, (char *)y + r0 * ldy * (out_f32 ? 4 : 2), ldy,
                           out_f32);
            }
        }
        _tile_release();
    }
    free(pad);
}

// Exact weights (NVFP4 with fp8 scales) at any row count: run_exact. Other blocks of 16 features at one or two rows
// go two to a step (17% faster at one row, Xeon-AMX); else in pairs, which measured faster for blocks of 32 and for
// more rows.
static void run(const uint16_t *x, int64_t m, int64_t ldx, const int64_t *desc, const uint16_t *bias, int64_t n,
                void *y, int64_t ldy, int threads, int out_f32) {
    qdesc q = read_desc(desc);
    if (q.exact)
        run_exact(x, m, ldx, &q, bias, n, y, ldy, threads, out_f32);
    else if (q.bkk == 8 && m <= 2)
        run_small(x, m, ldx, &q, bias, n, y, ldy, threads, out_f32);
    else
        run_pairs(x, m, ldx, &q, bias, n, y, ldy, threads, out_f32);
}

// The calls of qgemm.c (upesi_qgemm, upesi_qgemm_f32) on the tile unit.
QGEMM_ENTRY_POINTS(upesi_qgemm_amx, upesi_qgemm_amx_f32)
