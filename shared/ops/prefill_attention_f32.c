// Prefill attention for fp32 caches on x86-64 CPUs with AVX2 and FMA, flash-style: one sequence's chunk of new
// tokens against its paged cache (shared/ops/prefill_attention.py loads this; its reference is
// shared.ops.paged_attention.paged_attention_ref). prefill_attention.c is the bf16 kernel for AMX / AVX512-BF16.
//
// The sequence holds L tokens after this step; its n new tokens sit at positions L - n .. L - 1 and each attends
// causally every position up to its own (with a sliding window W > 0: only positions > its own - W).
//
// Transposed, keys as rows and queries as columns, so that the online softmax runs down columns with no sums
// across lanes: a tile is 24 (head, position) lanes of one key head, the heads of its group that share those keys
// (3 of them at 8 positions where the group divides by 3, else 2 at 12, else 1 at 24), in three vectors. Per block
// of 32 keys
//   S^T [32 keys, 24 lanes] = K . (scale Q)^T       4 keys a step: per dim, Q^T's three vectors times each key's
//                                                   value broadcast (12 accumulators)
//   the block's column maxima; where one grows, the running sums l and O^T are rescaled by e^(m - m');
//   P^T = e^(S^T - m) (exp_avx2.h's exp8, about 1 ulp), zero where a key is past a lane's position or before
//   its window; l += the column sums of P^T
//   O^T [Dh, 24 lanes] += V^T . P^T                4 dims a step: per key, P^T's three vectors times each value
//                                                  broadcast
// keys read in place from their cache rows (a row: Dh contiguous floats). Blocks past a tile's last position or
// before its first position's window are never read. out = (O^T / l)^T. Work items: the tiles, those with the
// most keys first, shared by the threads as they come free. A short prompt chunk beside decodes (8 rows of 9 heads
// in 3 groups: 3 tiles, all lanes used) does a third of the work 24-query tiles of one head would.
// Shapes: q, out [n, H, Dh] fp32 with rows ldq / ldo elements apart; caches [NB, BS, KVH, Dh]; table [MB] int64.
// Dh must be a multiple of 4, at most 256.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "exp_avx2.h"

#define QV 3            // vectors of lanes per tile (2: 8 accumulators, 3-8% slower at 2,000-6,000 keys)
#define QT (8 * QV)     // lanes per tile
#define KB 32           // keys per block
#define MAX_DH 256
#define M_FLOOR -1e30f  // a column's running maximum before any key: finite, so e^(m - m') is 0 and never NaN

typedef struct {
    const float *k, *v;
    const int64_t *table;
    int64_t bs, kvh, dh;
} cache_view;

static const float zero_row[MAX_DH];   // stands for keys past a block's last: their weights are 0

// All bits set in the lanes where key kj is visible to the lane's query at pos: kj <= pos, pos - kj < W.
static inline __m256 visible(__m256 pos, float kj, int64_t window) {
    __m256 k = _mm256_set1_ps(kj), on = _mm256_cmp_ps(k, pos, _CMP_LE_OQ);
    if (window > 0)
        on = _mm256_and_ps(on, _mm256_cmp_ps(_mm256_sub_ps(pos, k), _mm256_set1_ps((float)window), _CMP_LT_OQ));
    return on;
}

// S^T of keys kr[0..3] for the tile: st[j] (QV vectors) = sum_d kr[j][d] qt[d].
static inline void scores4(const float (*qt)[QT], const float *const *kr, int64_t dh, float (*st)[QT]) {
    __m256 a[4][QV];
    for (int t = 0; t < 4; t++)
        for (int h = 0; h < QV; h++)
            a[t][h] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dh; d++) {
        __m256 qv[QV];
        for (int h = 0; h < QV; h++)
            qv[h] = _mm256_load_ps(qt[d] + 8 * h);
        for (int t = 0; t < 4; t++) {
            __m256 kb = _mm256_broadcast_ss(kr[t] + d);
            for (int h = 0; h < QV; h++)
                a[t][h] = _mm256_fmadd_ps(kb, qv[h], a[t][h]);
        }
    }
    for (int t = 0; t < 4; t++)
        for (int h = 0; h < QV; h++)
            _mm256_store_ps(st[t] + 8 * h, a[t][h]);
}

// O^T[d0 .. d0 + 3] += sum_{j < nk} vr[j][d] P^T[j].
static inline void values4(const float (*pt)[QT], const float *const *vr, int nk, int64_t d0, float (*ot)[QT]) {
    __m256 a[4][QV];
    for (int t = 0; t < 4; t++)
        for (int h = 0; h < QV; h++)
            a[t][h] = _mm256_load_ps(ot[d0 + t] + 8 * h);
    for (int j = 0; j < nk; j++) {
        __m256 pv[QV];
        for (int h = 0; h < QV; h++)
            pv[h] = _mm256_load_ps(pt[j] + 8 * h);
        for (int t = 0; t < 4; t++) {
            __m256 vb = _mm256_broadcast_ss(vr[j] + d0 + t);
            for (int h = 0; h < QV; h++)
                a[t][h] = _mm256_fmadd_ps(vb, pv[h], a[t][h]);
        }
    }
    for (int t = 0; t < 4; t++)
        for (int h = 0; h < QV; h++)
            _mm256_store_ps(ot[d0 + t] + 8 * h, a[t][h]);
}

// One work item: positions i0 .. i0 + pt - 1 (those below n) of heads h0 .. h0 + gt - 1 (of key head kh), one
// (head, position) a lane: lane l is head h0 + l / pt at position i0 + l % pt (gt pt = QT).
static void tile(const float *q, int64_t ldq, float *out, int64_t ldo, const cache_view *c, int64_t i0, int64_t kh,
                 int64_t h0, int64_t pt, int64_t n, int64_t len, float scale, int64_t window) {
    float qt[MAX_DH][QT] __attribute__((aligned(32))), ot[MAX_DH][QT] __attribute__((aligned(32)));
    float st[KB][QT] __attribute__((aligned(32))), lane_pos[QT] __attribute__((aligned(32)));
    const int64_t dh = c->dh, rows = n - i0 < pt ? n - i0 : pt;
    const int64_t p0 = len - n + i0, kend = p0 + rows;             // keys [kstart, kend) reach some query
    int64_t row_of[QT], col_of[QT];                                 // a lane's row of q / out (-1: none), head
    for (int l = 0; l < QT; l++) {
        lane_pos[l] = (float)(p0 + l % pt);
        row_of[l] = l % pt < rows ? i0 + l % pt : -1;
        col_of[l] = (h0 + l / pt) * dh;
    }
    for (int l = 0; l < QT; l++)
        for (int64_t d = 0; d < dh; d++)
            qt[d][l] = row_of[l] >= 0 ? q[row_of[l] * ldq + col_of[l] + d] * scale : 0.0f;
    memset(ot, 0, sizeof(float) * QT * (size_t)dh);
    const int64_t kstart = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
    const __m256 minus_inf = _mm256_set1_ps(-__builtin_inff());
    __m256 pos[QV], m[QV], l[QV];
    for (int h = 0; h < QV; h++) {
        pos[h] = _mm256_load_ps(lane_pos + 8 * h);
        m[h] = _mm256_set1_ps(M_FLOOR);
        l[h] = _mm256_setzero_ps();
    }
    for (int64_t k0 = kstart; k0 < kend; k0 += KB) {
        const int nk = kend - k0 < KB ? (int)(kend - k0) : KB;
        const float *kr[KB], *vr[KB];
        int64_t blk = k0 / c->bs, at = k0 % c->bs;                  // one division a block of keys
        for (int j = 0; j < KB; j++, at++) {
            if (at == c->bs)
                blk++, at = 0;
            int64_t off = ((j < nk ? c->table[blk] : 0) * c->bs + at) * c->kvh * c->dh + kh * c->dh;
            kr[j] = j < nk ? c->k + off : zero_row;
            vr[j] = j < nk ? c->v + off : zero_row;
        }
        for (int j = 0; j < KB; j += 4)
            scores4((const float (*)[QT])qt, kr + j, dh, st + j);
        // a mask where a key may be past a query (the diagonal) or before a query's window
        const int masked = k0 + KB > p0 || (window > 0 && k0 <= kend - 1 - window);
        __m256 bm[QV];
        for (int h = 0; h < QV; h++)
            bm[h] = minus_inf;
        for (int j = 0; j < KB; j++)
            for (int h = 0; h < QV; h++) {
                __m256 s = _mm256_load_ps(st[j] + 8 * h);
                if (masked)
                    s = _mm256_blendv_ps(minus_inf, s, visible(pos[h], (float)(k0 + j), window));
                _mm256_store_ps(st[j] + 8 * h, s);
                bm[h] = _mm256_max_ps(bm[h], s);
            }
        __m256 grow[QV];
        int any = 0;
        for (int h = 0; h < QV; h++) {
            __m256 mn = _mm256_max_ps(m[h], bm[h]);
            any |= _mm256_movemask_ps(_mm256_cmp_ps(mn, m[h], _CMP_GT_OQ));
            grow[h] = exp8(_mm256_sub_ps(m[h], mn));
            m[h] = mn;
        }
        if (any)
            for (int h = 0; h < QV; h++) {
                l[h] = _mm256_mul_ps(l[h], grow[h]);
                for (int64_t d = 0; d < dh; d++)
                    _mm256_store_ps(ot[d] + 8 * h, _mm256_mul_ps(_mm256_load_ps(ot[d] + 8 * h), grow[h]));
            }
        for (int j = 0; j < nk; j++)
            for (int h = 0; h < QV; h++) {
                __m256 s = _mm256_load_ps(st[j] + 8 * h), p = exp8(_mm256_sub_ps(s, m[h]));
                p = _mm256_and_ps(p, _mm256_cmp_ps(s, minus_inf, _CMP_NEQ_OQ));
                l[h] = _mm256_add_ps(l[h], p);
                _mm256_store_ps(st[j] + 8 * h, p);
            }
        for (int64_t d = 0; d < dh; d += 4)
            values4((const float (*)[QT])st, vr, nk, d, ot);
    }
    float inv[QT] __attribute__((aligned(32)));
    for (int h = 0; h < QV; h++)
        _mm256_store_ps(inv + 8 * h, _mm256_div_ps(_mm256_set1_ps(1.0f), l[h]));
    for (int ln = 0; ln < QT; ln++)
        if (row_of[ln] >= 0)
            for (int64_t d = 0; d < dh; d++)
                out[row_of[ln] * ldo + col_of[ln] + d] = ot[d][ln] * inv[ln];
}

// q [n, H, Dh] (rows ldq apart) -> out [n, H, Dh] (rows ldo apart); 0 on success, -1 for a head size it does not
// take (the caller then uses torch).
int upesi_prefill_attention_f32(const float *q, int64_t ldq, float *out, int64_t ldo, const float *k_cache,
                                const float *v_cache, const int64_t *table, int64_t bs, int64_t n, int64_t len, int h,
                                int kvh, int64_t dh, float scale, int64_t window, int threads) {
    if (dh % 4 || dh > MAX_DH || h % kvh || n > len)
        return -1;
    cache_view c = {k_cache, v_cache, table, bs, kvh, dh};
    // a tile's lanes: gt heads of one key head (3 or 2 where the group divides by them) at QT / gt positions each
    const int64_t group = h / kvh, gt = group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1, pt = QT / gt;
    const int64_t per_kv = group / gt, tiles = (n + pt - 1) / pt, items = tiles * kvh * per_kv;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && items > 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t t = tiles - 1 - it / (kvh * per_kv), r = it % (kvh * per_kv);   // the most keys first
        tile(q, ldq, out, ldo, &c, t * pt, r / per_kv, r / per_kv * group + r % per_kv * gt, pt, n, len, scale,
             window);
    }
    return 0;
}
