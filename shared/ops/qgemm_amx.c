// Block-quantised linear layers on CPUs with AMX (shared/ops/qgemm.py loads this): the weights, descriptor and
// arithmetic of qgemm.c, with each block's products on the tile unit.
//
// A block's expanded codes (qgemm.h's expand: BKK pairs of features by 2 panels of 16 columns, 64 bytes each) are
// two AMX B tiles as they lie (BKK rows, 128 bytes apart), and a block of x's features for 16 rows one A tile. Per
// block and group of 16 rows, tdpbf16ps gives the block's sums for both panels, which are scaled into the rows'
// fp32 totals as qgemm.c does (scale * (sum - shift * sx) + min * sx). The AVX-512 work per row is then a few
// instructions per block instead of a dot product, so 32 rows cost little more than one.
//
// A row's result is the same whatever the other rows of the call are (rows past M in the last group are zeros of a
// padded copy of x), so a verification row is computed exactly as a decode row; the sums are in another order than
// qgemm.c's, so one machine uses one of the two kernels for every call.
// Shapes: M = rows, K = in features, N = out features, BKK = feature pairs per block, NB = blocks.
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "qgemm.h"

// Asks the kernel for the AMX tile state (once per process). Returns 0 when AMX may be used.
int upesi_qgemm_amx_setup(void) {
    return amx_request();
}

// Tiles 0-1: the block sums of the two panels [rows, 16] fp32; 2: x's block [rows, 2 BKK] bf16; 3-4: the panels'
// expanded codes [BKK, 32] bf16.
static void configure(int rows, int bkk) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[2] = (uint8_t)rows;
    c.colsb[0] = c.colsb[1] = 64;
    c.colsb[2] = (uint16_t)(4 * bkk);
    c.rows[3] = c.rows[4] = (uint8_t)bkk;
    c.colsb[3] = c.colsb[4] = 64;
    _tile_loadconfig(&c);
}

static void run(const uint16_t *x, int64_t m, int64_t ldx, const int64_t *desc, const uint16_t *bias, int64_t n,
                void *y, int64_t ldy, int threads, int out_f32) {
    qdesc q = read_desc(desc);
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
    #pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        __m512bh bufs[2][32];                              // alternating: a block's expansion never waits on the
        float acc[2][16 * 16];                             // tile loads of the one before
        float *tot = aligned_alloc(64, sizeof(float) * UNIT * (size_t)m);
        configure(rows, q.bkk);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            memset(tot, 0, sizeof(float) * UNIT * (size_t)m);
            const uint8_t *rec = q.data + u * q.nb * q.record;
            for (int64_t b = 0; b < q.nb; b++, rec += q.record) {
                __m512 sc[2], mn[2];
                __m512bh *buf = bufs[b & 1];
                expand(rec, q.kind, q.bkk, q.table, q.high, buf);
                block_scales(&q, rec, sc, mn);
                // tot += sc * (sums - shift * sx) + mn * sx  ==  sc * sums + (mn - shift * sc) * sx
                mn[0] = _mm512_fnmadd_ps(shift, sc[0], mn[0]);
                mn[1] = _mm512_fnmadd_ps(shift, sc[1], mn[1]);
                _tile_loadd(3, (const void *)buf, 128);
                _tile_loadd(4, (const void *)(buf + 1), 128);
                for (int64_t g = 0; g < groups; g++) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(2, (const void *)(x + g * 16 * ldx + b * bf), ldx * 2);
                    _tile_dpbf16ps(0, 2, 3);
                    _tile_dpbf16ps(1, 2, 4);
                    _tile_stored(0, acc[0], 64);
                    _tile_stored(1, acc[1], 64);
                    int64_t r0 = g * 16, valid = m - r0 < 16 ? m - r0 : 16;
                    for (int64_t r = 0; r < valid; r++) {
                        __m512 s = _mm512_set1_ps(sx[(r0 + r) * q.nb + b]);
                        float *t = tot + UNIT * (r0 + r);
                        _mm512_storeu_ps(t, _mm512_fmadd_ps(mn[0], s, _mm512_fmadd_ps(
                            _mm512_loadu_ps(acc[0] + 16 * r), sc[0], _mm512_loadu_ps(t))));
                        _mm512_storeu_ps(t + 16, _mm512_fmadd_ps(mn[1], s, _mm512_fmadd_ps(
                            _mm512_loadu_ps(acc[1] + 16 * r), sc[1], _mm512_loadu_ps(t + 16))));
                    }
                }
            }
            store_unit(tot, m, bias, n, u * UNIT, y, ldy, out_f32);
        }
        free(tot);
        _tile_release();
    }
    free(sx);
    free(pad);
}

// The calls of qgemm.c (upesi_qgemm, upesi_qgemm_f32) on the tile unit.
QGEMM_ENTRY_POINTS(upesi_qgemm_amx, upesi_qgemm_amx_f32)
