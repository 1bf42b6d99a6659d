// Prefill attention, flash-style: one sequence's chunk of new tokens against its paged bf16 cache
// (shared/ops/prefill_attention.py loads this; its reference is shared.ops.paged_attention.paged_attention_ref).
// Built twice: with UPESI_AMX_TILES the products run on AMX tiles (tdpbf16ps), without it on AVX512-BF16
// vectors (vdpbf16ps); the packing, the softmax and the work split are the same.
//
// The sequence holds L tokens after this step; its n new tokens sit at positions L - n .. L - 1 and each attends
// causally every position up to its own (with a sliding window W > 0: only positions > its own - W).
//
// Everything is computed transposed, keys as rows and queries as columns, so that the online softmax runs down
// columns: 16 queries in the lanes of one vector, each key one vector, with no sums across lanes and no branches.
// Both products take pairs of bf16 along the shared dimension:
//   S^T [32 keys, 16 queries] = K [keys, Dh] . Q^T           Q^T in pairs of dims, per key a pair broadcast
//   O^T [Dh, 16 queries]     += V^T [Dh, 32 keys] . P^T      P^T in pairs of keys, per dim a pair broadcast
// (on tiles: tdpbf16ps multiplies A [16 rows, 32 bf16] by B [16 pairs, 16 columns x 2 bf16], K and V^T as A).
// 1. Packing of the keys the chunk's rows can reach (keys past L are zeros), per block of 32 keys and KV head:
//      kp[key][Dh]                     the keys gathered from their cache slots
//      vt[block of 32 keys][Dh][32]   the values transposed (pairs of keys, then a 16 x 16 u32 transpose)
//    A long chunk packs the whole context once per call; a chunk of at most JIT_PAIRS pairs of tiles a KV head
//    (prompt chunks beside decodes) packs each block as it reads it, into its own L1 scratch (by_segments).
// 2. Work items: pairs of tiles (16 consecutive queries of one head each, both of one KV head), the most keys
//    first; or, for the few tiles of a short chunk, every tile of a KV head against one segment of its keys,
//    the segments' running maxima, sums and outputs merged after. Q^T packed once per tile. For each block of 32
//    keys up to the last query's position: S^T of both tiles (each key read once for both); per key vector the
//    scores are scaled into base 2 (s scale log2 e), masked on the blocks that cross a query's position or window
//    edge, and exponentiated against the column's reference maximum (2^t by a degree-5 polynomial and scalef); the
//    running sum and O^T (fp32) are rescaled when a column's maximum passes the reference by 2^LAZY; P^T is
//    rounded to bf16; O^T += V^T P^T with each value read once for both. Blocks past both tiles'
//    positions or before both windows are never read. out = (O^T / l)^T, rounded to bf16.
// Shapes: q, out [n, H, Dh] bf16 with rows ldq / ldo elements apart; caches [NB, BS, KVH, Dh]; table [MB] int64.
// Dh must be a multiple of 64, at most 256.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef UPESI_AMX_TILES
#include "amx.h"
#endif

#define LAZY 8.0f          // a column's reference maximum moves only when the scores pass it by this (base 2)
#define FLOOR_T (-126.0f)   // exponents (base 2) below this give 2^-126: nothing beside a column's maximum
#ifndef JIT_PAIRS
#define JIT_PAIRS 6         // pairs of tiles a KV head up to which a call runs by segments (by_segments)
#endif

#ifdef UPESI_AMX_TILES
int upesi_prefill_amx_setup(void) { return amx_request(); }

// S^T of two query tiles: tmm0-1 / tmm2-3 (keys 0-15, 16-31), tmm4-5 K chunks, tmm6 / tmm7 Q^T chunks.
// O^T: tmm0 / tmm1 the tiles' P^T, tmm2-3 V^T chunks, tmm4-7 chunks of 16 dims of O^T (two per tile).
static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}
#else
static void configure(void) {}
#endif

// 2^t for t in [FLOOR_T, LAZY]: 2^n 2^f, |f| <= 1/2, 2^f by its Taylor polynomial of degree 5 (relative error
// below 3e-6, far under bf16's rounding of P).
static inline __m512 exp2_16(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(FLOOR_T));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022651f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// 16 x 16 u32: rows r[i] -> r[i][j] becomes row j, column i.
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // each 128-bit lane now holds a 4 x 4 block; gather the lanes
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 2; j++) {
            __m512i a = r[i + 8 * j], b = r[i + 4 + 8 * j];
            t[i + 8 * j] = _mm512_shuffle_i32x4(a, b, 0x88);
            t[i + 4 + 8 * j] = _mm512_shuffle_i32x4(a, b, 0xdd);
        }
    }
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 2; j++) {
            __m512i a = t[i + 4 * j], b = t[i + 8 + 4 * j];
            r[i + 4 * j] = _mm512_shuffle_i32x4(a, b, 0x88);
            r[i + 8 + 4 * j] = _mm512_shuffle_i32x4(a, b, 0xdd);
        }
    }
}

typedef struct {
    const uint16_t *k_cache, *v_cache;
    const int64_t *table;
    int64_t bs, kvh, dh, base, len;   // keys base .. len - 1 are packed (base a multiple of 32)
} cache_view;

static inline const uint16_t *key_row(const cache_view *c, const uint16_t *cache, int64_t k, int head) {
    int64_t slot = c->table[k / c->bs] * c->bs + k % c->bs;
    return cache + (slot * c->kvh + head) * c->dh;
}

// The cache lines of keys k .. k + 31 of `heads` heads from `head`, K and V, asked for ahead of their packing.
static void prefetch_block(const cache_view *c, int64_t k, int head, int heads) {
    int64_t row = heads * c->dh * 2;                      // bytes of one position's heads
    for (int64_t j = 0; j < 32 && k + j < c->len; j++) {
        const char *kr = (const char *)key_row(c, c->k_cache, k + j, head);
        const char *vr = (const char *)key_row(c, c->v_cache, k + j, head);
        for (int64_t o = 0; o < row; o += 64) {
            _mm_prefetch(kr + o, _MM_HINT_T0);
            _mm_prefetch(vr + o, _MM_HINT_T0);
        }
    }
}

// Block b (32 keys from base + 32 b) of one head: keys into kp [32][Dh], values transposed into vt [Dh][32].
static void pack_block(const cache_view *c, int head, int64_t b, uint16_t *kp, uint16_t *vt) {
    int64_t dh = c->dh;
    for (int j = 0; j < 32; j++) {
        int64_t k = c->base + 32 * b + j;
        uint16_t *dst = kp + j * dh;
        const uint16_t *src = k < c->len ? key_row(c, c->k_cache, k, head) : NULL;
        for (int64_t d = 0; d < dh; d += 32)
            _mm512_storeu_si512(dst + d, src ? _mm512_loadu_si512(src + d) : _mm512_setzero_si512());
    }
    for (int64_t d0 = 0; d0 < dh; d0 += 16) {
        __m512i r[16];                                    // r[p] = 16 dims' (V[2p][d], V[2p + 1][d])
        for (int p = 0; p < 16; p++) {
            int64_t k = c->base + 32 * b + 2 * p;
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            if (k < c->len)
                lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(key_row(c, c->v_cache, k, head) + d0)));
            if (k + 1 < c->len)
                hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    (const void *)(key_row(c, c->v_cache, k + 1, head) + d0)));
            r[p] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        }
        transpose16(r);                                   // r[d] = dim d0 + d's 32 keys
        for (int d = 0; d < 16; d++)
            _mm512_storeu_si512(vt + (d0 + d) * 32, r[d]);
    }
}

// P^T's 32 key vectors (fp32, queries in lanes) -> the B tile: row p = per query (P[2p], P[2p + 1]) in bf16.
static inline void pack_p(const __m512 *e, uint16_t *dst) {
    static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i mix = _mm512_loadu_si512(order);
    for (int p = 0; p < 16; p++)
        _mm512_storeu_si512(dst + 32 * p, _mm512_permutexvar_epi16(mix, (__m512i)_mm512_cvtne2ps_pbh(e[2 * p + 1],
                                                                                                     e[2 * p])));
}

// One query tile: 16 consecutive queries of one head, and its running softmax state.
typedef struct {
    float s[32 * 16], o[256 * 16];   // S^T of the block [32 keys][16 queries]; O^T [Dh][16] fp32
    uint16_t p[16 * 32], qt[8 * 512];  // P^T as a B tile; Q^T per 32 dims: [16 pairs of dims][16 queries][2]
    int64_t i0, first, last;         // its first row; its first and last positions
    int head, rows;                  // rows 0: a stand-in beside the last tile (all its lanes are ignored)
} qtile;

// Q^T of a tile's rows (per 32 dims, a 16 x 16 u32 transpose; missing rows zeros) and an empty O^T.
static void start_tile(qtile *t, const uint16_t *q, int64_t ldq, int64_t dh) {
    for (int64_t ch = 0; ch < dh / 32; ch++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++)
            r[j] = j < t->rows ? _mm512_loadu_si512(q + (t->i0 + j) * ldq + t->head * dh + 32 * ch)
                               : _mm512_setzero_si512();
        transpose16(r);
        for (int p = 0; p < 16; p++)
            _mm512_storeu_si512(t->qt + ch * 512 + 32 * p, r[p]);
    }
    memset(t->o, 0, (size_t)dh * 16 * sizeof(float));
}

#ifdef UPESI_AMX_TILES
// S^T of two tiles for one block: the key tiles are loaded once for both, four independent sums per step; a lone
// tile (two = 0) computes only its own two.
static inline void scores(qtile *a, qtile *b, const uint16_t *ka, int64_t dh, int two) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ch = 0; ch < dh / 32; ch++) {
        _tile_loadd(4, ka + 32 * ch, dh * 2);
        _tile_loadd(5, ka + 16 * dh + 32 * ch, dh * 2);
        _tile_loadd(6, a->qt + ch * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
            _tile_loadd(7, b->qt + ch * 512, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, a->s, 64);
    _tile_stored(1, a->s + 256, 64);
    if (two) {
        _tile_stored(2, b->s, 64);
        _tile_stored(3, b->s + 256, 64);
    }
}

// O^T += V^T P^T for two tiles: each V^T chunk (16 dims) loaded once for both; a lone tile (two = 0) on its own.
static inline void accumulate(qtile *a, qtile *b, const uint16_t *vb, int64_t dh, int two) {
    if (!two) {
        _tile_loadd(0, a->p, 64);
        for (int64_t d = 0; d < dh; d += 16) {
            _tile_loadd(2, vb + d * 32, 64);
            _tile_loadd(4, a->o + d * 16, 64);
            _tile_dpbf16ps(4, 2, 0);
            _tile_stored(4, a->o + d * 16, 64);
        }
        return;
    }
    _tile_loadd(0, a->p, 64);
    _tile_loadd(1, b->p, 64);
    for (int64_t d = 0; d < dh; d += 32) {
        _tile_loadd(2, vb + d * 32, 64);
        _tile_loadd(4, a->o + d * 16, 64);
        _tile_loadd(5, b->o + d * 16, 64);
        _tile_dpbf16ps(4, 2, 0);
        _tile_dpbf16ps(5, 2, 1);
        _tile_loadd(3, vb + (d + 16) * 32, 64);
        _tile_loadd(6, a->o + (d + 16) * 16, 64);
        _tile_loadd(7, b->o + (d + 16) * 16, 64);
        _tile_dpbf16ps(6, 3, 0);
        _tile_dpbf16ps(7, 3, 1);
        _tile_stored(4, a->o + d * 16, 64);
        _tile_stored(5, b->o + d * 16, 64);
        _tile_stored(6, a->o + (d + 16) * 16, 64);
        _tile_stored(7, b->o + (d + 16) * 16, 64);
    }
}
#else
static inline __m512bh pair_at(const uint16_t *p) {           // a pair of bf16, broadcast to every lane
    int32_t v;
    memcpy(&v, p, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}

// S^T of one tile for one block, 16 keys at a time (each sum in the order of the two-tile loop below).
static inline void scores1(qtile *a, const uint16_t *ka, int64_t dh) {
    for (int k0 = 0; k0 < 32; k0 += 16) {
        __m512 sa[16];
        for (int j = 0; j < 16; j++)
            sa[j] = _mm512_setzero_ps();
        for (int64_t p = 0; p < dh / 2; p++) {
            __m512bh qa = (__m512bh)_mm512_loadu_si512(a->qt + 32 * p);
            for (int j = 0; j < 16; j++)
                sa[j] = _mm512_dpbf16_ps(sa[j], qa, pair_at(ka + (k0 + j) * dh + 2 * p));
        }
        for (int j = 0; j < 16; j++)
            _mm512_storeu_ps(a->s + 16 * (k0 + j), sa[j]);
    }
}

// S^T of two tiles for one block, 8 keys at a time: per pair of dims both tiles' Q^T vectors, each key's pair
// broadcast once for both (16 independent sums); a lone tile (two = 0) on its own.
static inline void scores(qtile *a, qtile *b, const uint16_t *ka, int64_t dh, int two) {
    if (!two) {
        scores1(a, ka, dh);
        return;
    }
    for (int k0 = 0; k0 < 32; k0 += 8) {
        __m512 sa[8], sb[8];
        for (int j = 0; j < 8; j++)
            sa[j] = sb[j] = _mm512_setzero_ps();
        for (int64_t p = 0; p < dh / 2; p++) {
            __m512bh qa = (__m512bh)_mm512_loadu_si512(a->qt + 32 * p);
            __m512bh qb = (__m512bh)_mm512_loadu_si512(b->qt + 32 * p);
            for (int j = 0; j < 8; j++) {
                __m512bh kk = pair_at(ka + (k0 + j) * dh + 2 * p);
                sa[j] = _mm512_dpbf16_ps(sa[j], qa, kk);
                sb[j] = _mm512_dpbf16_ps(sb[j], qb, kk);
            }
        }
        for (int j = 0; j < 8; j++) {
            _mm512_storeu_ps(a->s + 16 * (k0 + j), sa[j]);
            _mm512_storeu_ps(b->s + 16 * (k0 + j), sb[j]);
        }
    }
}

// O^T += V^T P^T for one tile, 16 dims at a time (each sum in the order of the two-tile loop below).
static inline void accumulate1(qtile *a, const uint16_t *vb, int64_t dh) {
    for (int64_t d0 = 0; d0 < dh; d0 += 16) {
        __m512 oa[16];
        for (int j = 0; j < 16; j++)
            oa[j] = _mm512_loadu_ps(a->o + 16 * (d0 + j));
        for (int p = 0; p < 16; p++) {
            __m512bh pa = (__m512bh)_mm512_loadu_si512(a->p + 32 * p);
            for (int j = 0; j < 16; j++)
                oa[j] = _mm512_dpbf16_ps(oa[j], pa, pair_at(vb + (d0 + j) * 32 + 2 * p));
        }
        for (int j = 0; j < 16; j++)
            _mm512_storeu_ps(a->o + 16 * (d0 + j), oa[j]);
    }
}

// O^T += V^T P^T for two tiles, 8 dims at a time: per pair of keys both tiles' P^T vectors, each dim's pair of
// values broadcast once for both; a lone tile (two = 0) on its own.
static inline void accumulate(qtile *a, qtile *b, const uint16_t *vb, int64_t dh, int two) {
    if (!two) {
        accumulate1(a, vb, dh);
        return;
    }
    for (int64_t d0 = 0; d0 < dh; d0 += 8) {
        __m512 oa[8], ob[8];
        for (int j = 0; j < 8; j++) {
            oa[j] = _mm512_loadu_ps(a->o + 16 * (d0 + j));
            ob[j] = _mm512_loadu_ps(b->o + 16 * (d0 + j));
        }
        for (int p = 0; p < 16; p++) {
            __m512bh pa = (__m512bh)_mm512_loadu_si512(a->p + 32 * p);
            __m512bh pb = (__m512bh)_mm512_loadu_si512(b->p + 32 * p);
            for (int j = 0; j < 8; j++) {
                __m512bh vv = pair_at(vb + (d0 + j) * 32 + 2 * p);
                oa[j] = _mm512_dpbf16_ps(oa[j], pa, vv);
                ob[j] = _mm512_dpbf16_ps(ob[j], pb, vv);
            }
        }
        for (int j = 0; j < 8; j++) {
            _mm512_storeu_ps(a->o + 16 * (d0 + j), oa[j]);
            _mm512_storeu_ps(b->o + 16 * (d0 + j), ob[j]);
        }
    }
}
#endif

// The online softmax of one tile's block (keys k0 .. k0 + 31): masked where the block crosses a query's position
// or window edge; the running maximum m and sum l (per query, in lanes) and O^T rescaled where m grew; P^T out.
static inline void softmax_block(qtile *t, __m512 *m, __m512 *l, int64_t k0, int64_t window, float scale,
                                 int64_t dh) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int)t->first), iota);       // each query's position
    const __m512i from = _mm512_sub_epi32(pos, _mm512_set1_epi32((int)window));         // window: keys > from
    const __m512 c2 = _mm512_set1_ps(scale * 1.44269504f), ninf = _mm512_set1_ps(-INFINITY);
    __m512 e[32], top = ninf;
    int edge = k0 + 31 > t->first || (window && k0 <= t->last - window);
    for (int k = 0; k < 32; k++) {
        e[k] = _mm512_loadu_ps(t->s + 16 * k);
        if (edge) {
            __m512i key = _mm512_set1_epi32((int)(k0 + k));
            __mmask16 ok = _mm512_cmple_epi32_mask(key, pos);
            if (window)
                ok &= _mm512_cmpgt_epi32_mask(key, from);
            e[k] = _mm512_mask_mov_ps(ninf, ok, e[k]);
        }
        top = _mm512_max_ps(top, e[k]);
    }
    __m512 mn = _mm512_max_ps(*m, _mm512_mul_ps(top, c2));
    // Rescaled only where a column's maximum passed the one in use by more than LAZY: until then its weights
    // stay below 2^LAZY (fine in fp32 and bf16), and the sums and O^T share the same reference anyway.
    if (_mm512_cmp_ps_mask(mn, _mm512_add_ps(*m, _mm512_set1_ps(LAZY)), _CMP_GT_OQ)) {
        __m512 alpha = exp2_16(_mm512_sub_ps(*m, mn));
        *l = _mm512_mul_ps(*l, alpha);
        for (int64_t d = 0; d < dh; d++)
            _mm512_storeu_ps(t->o + 16 * d, _mm512_mul_ps(_mm512_loadu_ps(t->o + 16 * d), alpha));
        *m = mn;
    }
    __m512 sum = *l, ref = *m;
    for (int k = 0; k < 32; k++) {
        __m512 p = exp2_16(_mm512_fmsub_ps(e[k], c2, ref));
        if (edge)                                          // masked keys: exactly nothing
            p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e[k], ninf, _CMP_NEQ_OQ), p);
        e[k] = p;
        sum = _mm512_add_ps(sum, p);
    }
    *l = sum;
    pack_p(e, t->p);
}

// out rows of a finished tile: O^T's columns / l, transposed back 16 dims at a time, rounded to bf16.
static void finish_tile(const qtile *t, __m512 l, uint16_t *out, int64_t ldo, int64_t dh) {
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int64_t d0 = 0; d0 < dh; d0 += 16) {
        __m512i r[16];
        for (int d = 0; d < 16; d++)
            r[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(t->o + 16 * (d0 + d)), inv));
        transpose16(r);                                   // r[j] = query j's 16 dims
        for (int j = 0; j < t->rows; j++)
            _mm256_storeu_si256((void *)(out + (t->i0 + j) * ldo + t->head * dh + d0),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[j])));
    }
}

// Tile u of KV head g (unit u, as pair_of_units below numbers them) over the chunk's n rows, Q^T packed, O^T empty.
static void place_tile(qtile *t, const uint16_t *q, int64_t ldq, int g, int group, int64_t u, int64_t n,
                       const cache_view *c) {
    int64_t tiles = (n + 15) / 16;
    t->head = g * group + (int)(u % group);
    t->i0 = 16 * (tiles - 1 - u / group);
    t->rows = (int)(n - t->i0 < 16 ? n - t->i0 : 16);
    t->first = c->len - n + t->i0;
    t->last = t->first + 15;
    start_tile(t, q, ldq, c->dh);
}

// One work item: two tiles of one KV head's query heads (16 rows each; the second a stand-in with no rows where the
// count is odd), sharing every key and value tile. unit u of KV head g: rows 16 (tiles - 1 - u / group) on of
// query head g group + u % group, so a pair shares its positions or neighbours them, the most keys first.
// Blocks past both tiles' last positions, or before both windows, are never read.
static void pair_of_units(const uint16_t *q, int64_t ldq, uint16_t *out, int64_t ldo, int g, int group,
                          int64_t u0, int64_t units, const cache_view *c, int64_t n, int64_t window, float scale,
                          const uint16_t *kp, const uint16_t *vt, qtile *t) {
    int64_t dh = c->dh, last = 0, lo = INT64_MAX;
    for (int i = 0; i < 2; i++) {
        place_tile(&t[i], q, ldq, g, group, u0 + i < units ? u0 + i : u0, n, c);
        if (u0 + i >= units)
            t[i].rows = 0;                                 // a stand-in: the first tile's rows, all ignored
        if (t[i].rows) {
            int64_t end = t[i].first + t[i].rows - 1, from = window ? t[i].first - window + 1 : 0;
            last = end > last ? end : last;
            lo = from < lo ? from : lo;
        }
    }
    __m512 m[2] = {_mm512_set1_ps(-1e30f), _mm512_set1_ps(-1e30f)}, l[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    lo = lo < c->base ? c->base : lo;
    int two = t[1].rows > 0;
    for (int64_t b = (lo - c->base) / 32; c->base + 32 * b <= last; b++) {
        int64_t k0 = c->base + 32 * b;
        scores(&t[0], &t[1], kp + 32 * b * dh, dh, two);
        softmax_block(&t[0], &m[0], &l[0], k0, window, scale, dh);
        if (two)
            softmax_block(&t[1], &m[1], &l[1], k0, window, scale, dh);
        accumulate(&t[0], &t[1], vt + 32 * b * dh, dh, two);
    }
    finish_tile(&t[0], l[0], out, ldo, dh);
    if (t[1].rows)
        finish_tile(&t[1], l[1], out, ldo, dh);
}

// Whether a tile's rows attend any key of the block from k0: not past the last row's position, not before the
// first row's window.
static inline int reaches(const qtile *t, int64_t k0, int64_t window) {
    return k0 <= t->first + t->rows - 1 && (!window || k0 + 31 > t->first - window);
}

// A chunk of a few tiles a KV head (prompt chunks beside decodes): one item per KV head and segment of its key
// blocks [b0, b1), every tile of the head in it, so that each block is read from the cache and packed once (into
// the item's own scratch, where it stays in L1) for all of them. The item leaves, per tile, its running maximum
// and sum and its unnormalised O^T in part (units x [16 m, 16 l, Dh x 16 O^T] floats); merge_tile adds the
// segments up.
static void head_segment(const uint16_t *q, int64_t ldq, int g, int group, int64_t n, const cache_view *c,
                         int64_t window, float scale, int64_t b0, int64_t b1, qtile *t, uint16_t *own, float *part) {
    int64_t dh = c->dh, units = group * ((n + 15) / 16), stride = 32 + 16 * dh;
    __m512 m[2 * JIT_PAIRS], l[2 * JIT_PAIRS];
    for (int64_t u = 0; u < units; u++) {
        place_tile(&t[u], q, ldq, g, group, u, n, c);
        m[u] = _mm512_set1_ps(-1e30f);
        l[u] = _mm512_setzero_ps();
    }
    for (int64_t b = b0; b < b1; b++) {
        int64_t k0 = c->base + 32 * b;
        if (b + 2 < b1)
            prefetch_block(c, k0 + 64, g, 1);
        pack_block(c, g, b, own, own + 32 * dh);
        for (int64_t u = 0; u < units; u += 2) {           // in pairs sharing each key and value read
            int64_t v = u + 1 < units ? u + 1 : u;
            int ra = reaches(&t[u], k0, window), rb = v != u && reaches(&t[v], k0, window);
            if (!ra && !rb)
                continue;
            int64_t a = ra ? u : v, o = ra && rb ? v : a;
            scores(&t[a], &t[o], own, dh, a != o);
            softmax_block(&t[a], &m[a], &l[a], k0, window, scale, dh);
            if (a != o)
                softmax_block(&t[o], &m[o], &l[o], k0, window, scale, dh);
            accumulate(&t[a], &t[o], own + 32 * dh, dh, a != o);
        }
    }
    for (int64_t u = 0; u < units; u++) {
        float *pu = part + u * stride;
        _mm512_storeu_ps(pu, m[u]);
        _mm512_storeu_ps(pu + 16, l[u]);
        memcpy(pu + 32, t[u].o, sizeof(float) * (size_t)(16 * dh));
    }
}

// Tile u of KV head g from its segments' parts (each `stride` floats, segs of them `apart` floats apart): maxima
// to the largest, sums and O^T rescaled to it and added, then out as finish_tile writes it.
static void merge_tile(const uint16_t *q, int64_t ldq, uint16_t *out, int64_t ldo, int g, int group, int64_t u,
                       int64_t n, const cache_view *c, const float *part, int64_t segs, int64_t apart, qtile *t) {
    int64_t dh = c->dh;
    place_tile(t, q, ldq, g, group, u, n, c);
    __m512 top = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();
    for (int64_t s = 0; s < segs; s++)
        top = _mm512_max_ps(top, _mm512_loadu_ps(part + s * apart));
    for (int64_t s = 0; s < segs; s++) {
        const float *ps = part + s * apart;
        __m512 w = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(ps), top));
        l = _mm512_fmadd_ps(_mm512_loadu_ps(ps + 16), w, l);
        for (int64_t d = 0; d < dh; d++)
            _mm512_storeu_ps(t->o + 16 * d, _mm512_fmadd_ps(_mm512_loadu_ps(ps + 32 + 16 * d), w,
                                                            _mm512_loadu_ps(t->o + 16 * d)));
    }
    finish_tile(t, l, out, ldo, dh);
}

// upesi_prefill_attention for a chunk of at most JIT_PAIRS pairs of tiles a KV head: head_segment's items (KV
// heads x segments, at least two items a thread where the keys allow), then merge_tile's.
static int by_segments(const uint16_t *q, int64_t ldq, uint16_t *out, int64_t ldo, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int64_t *table, int64_t bs, int64_t n, int64_t len, int h,
                       int kvh, int64_t dh, float scale, int64_t window, int nt, int64_t base, int64_t blocks) {
    int64_t group = h / kvh, units = group * ((n + 15) / 16), stride = 32 + 16 * dh;
    int64_t segs = (2 * nt + kvh - 1) / kvh;              // base is already the first row's window start
    segs = segs < blocks ? segs : blocks;
    qtile *work = aligned_alloc(64, (size_t)(nt * units) * sizeof(qtile));
    uint16_t *own = aligned_alloc(64, (size_t)(nt * 64 * dh) * 2);
    float *part = malloc(sizeof(float) * (size_t)(kvh * segs * units * stride));
    if (!work || !own || !part) {
        free(work);
        free(own);
        free(part);
        return -1;
    }
    cache_view c = {k_cache, v_cache, table, bs, kvh, dh, base, len};
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int me = omp_get_thread_num();
        configure();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < kvh * segs; i++) {
            int64_t g = i / segs, s = i % segs;
            head_segment(q, ldq, (int)g, (int)group, n, &c, window, scale, s * blocks / segs,
                         (s + 1) * blocks / segs, work + me * units, own + me * 64 * dh,
                         part + (g * segs + s) * units * stride);
        }
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < kvh * units; i++) {
            int64_t g = i / units, u = i % units;
            merge_tile(q, ldq, out, ldo, (int)g, (int)group, u, n, &c, part + (g * segs * units + u) * stride, segs,
                       units * stride, work + me * units);
        }
#ifdef UPESI_AMX_TILES
        _tile_release();
#endif
    }
    free(work);
    free(own);
    free(part);
    return 0;
}

// q [n, H, Dh] bf16 (rows ldq apart, rotated), out [n, H, Dh] bf16 (rows ldo apart), caches [NB, BS, KVH, Dh]
// bf16 already holding this chunk's keys and values, table [MB] int64, len = L, window = W (0: none).
// Returns 0, or -1 where Dh is not a multiple of 64 up to 256 or the scratch could not be allocated.
int upesi_prefill_attention(const uint16_t *q, int64_t ldq, uint16_t *out, int64_t ldo, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *table, int64_t bs, int64_t n, int64_t len,
                                int h, int kvh, int64_t dh, float scale, int64_t window, int threads) {
    if (dh % 64 || dh > 256 || n <= 0 || n > len)
        return -1;
    int64_t base = window ? len - n - window + 1 : 0;
    base = base < 0 ? 0 : base & ~(int64_t)31;
    int64_t blocks = (len - base + 31) / 32, per_head = blocks * 32 * dh;
    int64_t group = h / kvh, units = group * ((n + 15) / 16), pairs = (units + 1) / 2;
    int nt = threads > 1 ? threads : 1;
    if (pairs <= JIT_PAIRS)
        return by_segments(q, ldq, out, ldo, k_cache, v_cache, table, bs, n, len, h, kvh, dh, scale, window, nt,
                           base, blocks);
    uint16_t *kp = malloc((size_t)(2 * kvh * per_head) * 2);
    qtile *work = aligned_alloc(64, (size_t)(2 * nt) * sizeof(qtile));
    if (!kp || !work) {
        free(kp);
        free(work);
        return -1;
    }
    uint16_t *vt = kp + kvh * per_head;
    cache_view c = {k_cache, v_cache, table, bs, kvh, dh, base, len};
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {             // in the cache's order: a position holds every head
            if (b + 2 < blocks)
                prefetch_block(&c, base + 32 * (b + 2), 0, kvh);
            for (int g = 0; g < kvh; g++)
                pack_block(&c, g, b, kp + g * per_head + 32 * b * dh, vt + g * per_head + 32 * b * dh);
        }
        qtile *w = work + 2 * omp_get_thread_num();
        configure();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < pairs * kvh; t++) {         // the last queries (most keys) first
            int g = (int)(t % kvh);
            pair_of_units(q, ldq, out, ldo, g, (int)group, 2 * (t / kvh), units, &c, n, window, scale,
                          kp + g * per_head, vt + g * per_head, w);
        }
#ifdef UPESI_AMX_TILES
        _tile_release();
#endif
    }
    free(kp);
    free(work);
    return 0;
}
