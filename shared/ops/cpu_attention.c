// Paged attention and RoPE + KV store for CPUs, fp32 or bf16 (shared/ops/cpu_attention.py loads this with ctypes).
//
// Shapes: T = rows of the step, H / KVH = query / kv heads, G = H / KVH, Dh = head dim, BS = block size,
// MB = max blocks per sequence, P = rope table positions.
//
// upesi_rope_store: qkv [T, (H + 2 KVH) Dh] (rows `row_stride` apart), cos / sin [T, R] in the same dtype ->
// the first R (rotary) dims of q and k rotated in place, the others left as they are (partial rotary: R < Dh)
// ("rotate half", as the torch path: x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype,
// no fused multiply-add), then k and v stored at their cache slots.
//
// upesi_paged_attention: query rows described by (row, seq, ctx, j, bits): a row attends the ctx cached positions
// before its sequence's new tokens, then new token i for i <= j where i == 0 or bit i - 1 of `bits` is set (-1:
// causal; a draft tree's ancestors otherwise, shared.engine.tree). Rows come in blocks of one sequence (a
// verification's rows, a decode alone), which read each K and V row once for all of them. Scores, softmax and the
// accumulator are fp32; each score is its own dot product, and every sum over positions runs in position order over
// the positions the row attends, so a row's result does not depend on the other rows of the step: a verification
// row is computed as the decode row it replaces.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "bf16_512.h"
#include "exp_avx2.h"

static int rope_avx512 = -1;           // RoPE's AVX-512 path; -1: where the CPU has it

// Chooses RoPE's path: 1 AVX-512 where the CPU has it, 0 AVX2 (the same bits); returns whether AVX-512 runs.
int upesi_rope_avx512(int on) { return avx512_choose(&rope_avx512, on); }

#define PREFETCH 16           // rows of K and V read ahead (about a DRAM latency of work at 64 dims)


static inline void load_row(const void *base, int64_t off, int n, int bf16, float *dst) {
    if (bf16)
        bf16_row_to_f32((const uint16_t *)base + off, n, dst);
    else
        memcpy(dst, (const float *)base + off, (size_t)n * 4);
}

static inline void store_row(void *base, int64_t off, int n, int bf16, const float *src) {
    if (bf16)
        f32_row_to_bf16(src, n, (uint16_t *)base + off);
    else
        memcpy((float *)base + off, src, (size_t)n * 4);
}

// x * cos + rot * sin for 8 lanes, each product and the sum rounded to bf16 where bf16 (no fused multiply-add).
static inline __m256 rope8(__m256 x, __m256 rot, __m256 c, __m256 s, int bf16) {
    __m256 a = _mm256_mul_ps(x, c), b = _mm256_mul_ps(rot, s);
    if (!bf16) return _mm256_add_ps(a, b);
    return round_bf16x8(_mm256_add_ps(round_bf16x8(a), round_bf16x8(b)));
}

// One head [Dh] rotated in place by this row's cos / sin [Dh] (values of the dtype, so no rounding of them here).
static void rope_head(float *x, const float *cos, const float *sin, int dh, int bf16) {
    int half = dh / 2;
    if (half % 8 == 0) {
        __m256 neg = _mm256_set1_ps(-0.f);
        for (int d = 0; d < half; d += 8) {
            __m256 lo = _mm256_loadu_ps(x + d), hi = _mm256_loadu_ps(x + half + d);
            __m256 out_lo = rope8(lo, _mm256_xor_ps(hi, neg), _mm256_loadu_ps(cos + d), _mm256_loadu_ps(sin + d), bf16);
            __m256 out_hi = rope8(hi, lo, _mm256_loadu_ps(cos + half + d), _mm256_loadu_ps(sin + half + d), bf16);
            _mm256_storeu_ps(x + d, out_lo);
            _mm256_storeu_ps(x + half + d, out_hi);
        }
        return;
    }
    float r[512];
    for (int d = 0; d < dh; d++) {
        float rot = d < half ? -x[d + half] : x[d - half];
        if (bf16) {
            r[d] = round_bf16(round_bf16(x[d] * cos[d]) + round_bf16(rot * sin[d]));
        } else {
            float a = x[d] * cos[d], b = rot * sin[d];
            r[d] = a + b;
        }
    }
    memcpy(x, r, (size_t)dh * 4);
}

// x * cos + rot * sin for 16 lanes, rounded as rope8.
UPESI_AVX512 static inline __m512 rope16(__m512 x, __m512 rot, __m512 c, __m512 s, int bf16) {
    __m512 a = _mm512_mul_ps(x, c), b = _mm512_mul_ps(rot, s);
    if (!bf16) return _mm512_add_ps(a, b);
    return bf16x16_round(_mm512_add_ps(bf16x16_round(a), bf16x16_round(b)));
}

// One row of upesi_rope_store on AVX-512 (rot a multiple of 32): each head rotated in registers, the unrotated
// dims and v copied as they are (a bf16 -> fp32 -> bf16 round trip is the identity).
UPESI_AVX512 static void rope_store_row_512(char *row, const void *cos, const void *sin, char *k_dst, char *v_dst,
                                            int h, int kvh, int dh, int rot, int bf16) {
    int64_t e = bf16 ? 2 : 4, half = rot / 2;
    __m512i neg = _mm512_set1_epi32((int)0x80000000u);
    for (int hh = 0; hh < h + kvh; hh++) {                   // q heads, then k heads
        char *x = row + (int64_t)hh * dh * e;
        for (int64_t d = 0; d < half; d += 16) {
            __m512 lo = row16_load(x, d, 0xffff, bf16), hi = row16_load(x, half + d, 0xffff, bf16);
            __m512 minus_hi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(hi), neg));
            __m512 out_lo = rope16(lo, minus_hi, row16_load(cos, d, 0xffff, bf16), row16_load(sin, d, 0xffff, bf16),
                                   bf16);
            __m512 out_hi = rope16(hi, lo, row16_load(cos, half + d, 0xffff, bf16),
                                   row16_load(sin, half + d, 0xffff, bf16), bf16);
            row16_store(x, d, out_lo, 0xffff, bf16);
            row16_store(x, half + d, out_hi, 0xffff, bf16);
        }
        if (hh >= h) memcpy(k_dst + (int64_t)(hh - h) * dh * e, x, (size_t)(dh * e));
    }
    memcpy(v_dst, row + (int64_t)(h + kvh) * dh * e, (size_t)(kvh * dh * e));
}

void upesi_rope_store(void *qkv, int64_t t, int64_t row_stride, int h, int kvh, int dh, int rot, const void *cos,
                      const void *sin, void *k_cache, void *v_cache, const int64_t *slots, int bf16) {
    if (rot % 32 == 0 && avx512_chosen(&rope_avx512)) {
        int64_t e = bf16 ? 2 : 4;
        #pragma omp parallel for schedule(static) if (t > 1)
        for (int64_t r = 0; r < t; r++)
            rope_store_row_512((char *)qkv + r * row_stride * e, (const char *)cos + r * rot * e,
                               (const char *)sin + r * rot * e, (char *)k_cache + slots[r] * kvh * dh * e,
                               (char *)v_cache + slots[r] * kvh * dh * e, h, kvh, dh, rot, bf16);
        return;
    }
    #pragma omp parallel for schedule(static) if (t > 1)
    for (int64_t r = 0; r < t; r++) {
        float x[512], c[512], s[512];
        load_row(cos, r * rot, rot, bf16, c);
        load_row(sin, r * rot, rot, bf16, s);
        int64_t base = r * row_stride;
        for (int hh = 0; hh < h + kvh; hh++) {                   // q heads, then k heads
            int64_t off = base + (int64_t)hh * dh;
            load_row(qkv, off, dh, bf16, x);
            rope_head(x, c, s, rot, bf16);                       // the first `rot` dims; the rest pass through
            store_row(qkv, off, dh, bf16, x);
            if (hh >= h) store_row(k_cache, (slots[r] * kvh + (hh - h)) * dh, dh, bf16, x);
        }
        for (int g = 0; g < kvh; g++) {
            load_row(qkv, base + (int64_t)(h + kvh + g) * dh, dh, bf16, x);
            store_row(v_cache, (slots[r] * kvh + g) * dh, dh, bf16, x);
        }
    }
}

// The cache slot of position p of a sequence whose block table row is `table`.
static inline int64_t slot_of(const int64_t *table, int64_t p, int bs) { return table[p / bs] * bs + p % bs; }

// Sums of 8 vectors, lane by lane -> [sum(v0), ..., sum(v7)], each by the same tree of adds.
static inline __m256 hsum8(const __m256 *v) {
    __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    a = _mm256_hadd_ps(a, b);
    c = _mm256_hadd_ps(c, d);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31));
}

// cap tanh(s / cap), Gemma 2's soft-capped scores: tanh |y| = (1 - e^{-2|y|}) / (1 + e^{-2|y|}), y's sign kept.
static inline __m256 softcap8(__m256 s, float cap) {
    __m256 y = _mm256_div_ps(s, _mm256_set1_ps(cap)), neg = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
    __m256 t = exp8(_mm256_mul_ps(_mm256_andnot_ps(neg, y), _mm256_set1_ps(-2.f)));
    __m256 th = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
    return _mm256_mul_ps(_mm256_or_ps(th, _mm256_and_ps(y, neg)), _mm256_set1_ps(cap));
}

// Whether a row (ctx, j, bits) attends position p of its sequence.
static inline int attends(int64_t p, int64_t ctx, int64_t j, uint64_t bits) {
    if (p < ctx) return 1;
    int64_t i = p - ctx;
    return i <= j && (i == 0 || ((bits >> (i - 1)) & 1u));
}

// Sum of a row's attended (exponentiated) scores, by one fixed procedure over them in position order: 8 lanes
// over whole groups of 8, one tree across the lanes, then the rest one by one. A row that attends the same
// positions in the same order gets the same total whatever else the step holds.
static inline float ordered_sum(const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    float total = _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
    for (; i < n; i++) total += x[i];
    return total;
}

// Rows of the positions p0 .. p0 + 7 of one kv head into dst [8, Dh] as fp32 (zeros past n).
static inline void load_tile(const void *cache, const int64_t *slots, int64_t p0, int64_t n, int kvh, int grp, int dh,
                             int bf16, float *dst) {
    int64_t esz = bf16 ? 2 : 4, row = dh * esz;
    for (int64_t p = p0 + 8; p < p0 + 16 && p < n; p++)              // the next tile's rows, while this one converts
        for (int64_t b = 0; b < row; b += 64)
            _mm_prefetch((const char *)cache + (slots[p] * kvh + grp) * row + b, _MM_HINT_T0);
    for (int i = 0; i < 8; i++) {
        if (p0 + i < n) load_row(cache, (slots[p0 + i] * kvh + grp) * dh, dh, bf16, dst + i * dh);
        else memset(dst + i * dh, 0, sizeof(float) * (size_t)dh);
    }
}

// q [Dh] . k_i [Dh] for the tile's 8 rows k_i (dh apart) -> 8 lanes: each dot product's 8 lanes accumulate over
// the head dim in order (eight independent chains in registers), then one tree sums them.
static inline __m256 dot_tile(const float *q, const float *k, int dh) {
    __m256 p[8];
    for (int i = 0; i < 8; i++) p[i] = _mm256_setzero_ps();
    for (int x = 0; x < dh; x += 8) {
        __m256 qx = _mm256_loadu_ps(q + x);
        p[0] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + x), p[0]);
        p[1] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + dh + x), p[1]);
        p[2] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 2 * dh + x), p[2]);
        p[3] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 3 * dh + x), p[3]);
        p[4] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 4 * dh + x), p[4]);
        p[5] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 5 * dh + x), p[5]);
        p[6] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 6 * dh + x), p[6]);
        p[7] = _mm256_fmadd_ps(qx, _mm256_loadu_ps(k + 7 * dh + x), p[7]);
    }
    return hsum8(p);
}

// a [8 k .. 8 k + 63] += sum over the tile's positions i < cnt, in order, of w[i] * v[i][same lanes] (rows of v dh
// apart): eight independent chains held in registers (axpy_tile1: one).
static inline void axpy_tile8(float *a, const float *w, const float *v, int dh, int cnt) {
    __m256 s[8];
    for (int x = 0; x < 8; x++) s[x] = _mm256_loadu_ps(a + 8 * x);
    for (int i = 0; i < cnt; i++) {
        __m256 wi = _mm256_set1_ps(w[i]);
        const float *vi = v + i * dh;
        for (int x = 0; x < 8; x++) s[x] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vi + 8 * x), s[x]);
    }
    for (int x = 0; x < 8; x++) _mm256_storeu_ps(a + 8 * x, s[x]);
}

static inline void axpy_tile1(float *a, const float *w, const float *v, int dh, int cnt) {
    __m256 s0 = _mm256_loadu_ps(a);
    for (int i = 0; i < cnt; i++) s0 = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), _mm256_loadu_ps(v + i * dh), s0);
    _mm256_storeu_ps(a, s0);
}

// The bf16 cache on CPUs with AVX-512 (AVX512-BF16 for the scores), head dims a multiple of 32, when the loader
// turns it on (upesi_attention_avx512): the scores by vdpbf16ps straight from the cache, the weighted sum of V
// with each V row widened in registers and every row's accumulator held in zmm registers. The sum of V is the
// same sequence of fused multiply-adds per output lane as axpy_tile8's (bit-identical); the scores are another
// fixed procedure, so one process uses one of the two paths for every row.
static int use_avx512 = 0;

void upesi_attention_avx512(int on) { use_avx512 = on; }

#define AVX512_BF16 __attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16")))

// Raw scores q . k * scale of `nq` bf16 query heads qb [nq, Dh] against positions p_start .. npad - 1 (whole tiles
// of 8) of one kv head: each score is one chain of Dh / 16 dpbf16 steps over 8 lanes (pairs of dims) in dim order,
// then hsum8's tree, so it does not depend on the tile or the rows around it. Positions from n on read zeros.
static const uint16_t zero_row[512];

AVX512_BF16 static void scores_dpbf16(const uint16_t *qb, int64_t nq, const uint16_t *k_cache, const int64_t *slots,
                                      int64_t p_start, int64_t n, int64_t npad, int kvh, int grp, int dh,
                                      float scale, float *scores, int64_t cap) {
    for (int64_t p0 = p_start; p0 < npad; p0 += 8) {
        const uint16_t *kr[8];
        for (int i = 0; i < 8; i++)
            kr[i] = p0 + i < n ? k_cache + (slots[p0 + i] * kvh + grp) * dh : zero_row;
        for (int64_t p = p0 + PREFETCH; p < p0 + PREFETCH + 8 && p < n; p++)   // a later tile's rows
            for (int b = 0; b < dh * 2; b += 64)
                _mm_prefetch((const char *)(k_cache + (slots[p] * kvh + grp) * dh) + b, _MM_HINT_T0);
        for (int64_t re = 0; re < nq; re++) {
            const uint16_t *qr = qb + re * dh;
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
            for (int x = 0; x < dh; x += 16) {
                __m256bh qx = (__m256bh)_mm256_loadu_si256((const void *)(qr + x));
                for (int i = 0; i < 8; i++)
                    a[i] = _mm256_dpbf16_ps(a[i], qx, (__m256bh)_mm256_loadu_si256((const void *)(kr[i] + x)));
            }
            _mm256_storeu_ps(scores + re * cap + p0, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
        }
    }
}

// acc [NQ, Dh] (rows dh apart) lanes c0 .. c0 + 16 W - 1 += sum over positions p_start .. n - 1, in order, of
// w[q][p] * v_p (bf16 rows, widened), for NQ <= 4 weight rows w (cap apart) and W <= 4 zmm of lanes.
static inline __attribute__((always_inline)) AVX512_BF16 void pv_chunk(
        const float *w, int64_t cap, const int nq, const int nw, const uint16_t *v_cache, const int64_t *slots,
        int64_t p_start, int64_t n, int64_t pos_stride, int64_t c0, float *acc, int64_t dh) {
    __m512 a[4][4];
    for (int q = 0; q < nq; q++)
        for (int j = 0; j < nw; j++) a[q][j] = _mm512_loadu_ps(acc + q * dh + c0 + 16 * j);
    for (int64_t p = p_start; p < n; p++) {
        const uint16_t *v = v_cache + slots[p] * pos_stride + c0;
        if (p + PREFETCH < n)                                  // every line of this chunk, PREFETCH rows ahead
            for (int b = 0; b < nw * 32; b += 32)
                _mm_prefetch((const char *)(v_cache + slots[p + PREFETCH] * pos_stride + c0 + b), _MM_HINT_T0);
        __m512 vv[4];
        for (int j = 0; j < nw; j++)
            vv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                        _mm256_loadu_si256((const __m256i *)(v + 16 * j))), 16));
        for (int q = 0; q < nq; q++) {
            __m512 wq = _mm512_set1_ps(w[q * cap + p]);
            for (int j = 0; j < nw; j++) a[q][j] = _mm512_fmadd_ps(wq, vv[j], a[q][j]);
        }
    }
    for (int q = 0; q < nq; q++)
        for (int j = 0; j < nw; j++) _mm512_storeu_ps(acc + q * dh + c0 + 16 * j, a[q][j]);
}

// acc [nq, Dh] += the weights [nq, cap] times the bf16 V rows of positions p_start .. n - 1 of one kv head
// (`off` into each position's row of the cache), lanes in chunks of 64 (or 32), rows in groups of up to 4.
AVX512_BF16 static void pv_bf16(const float *w, int64_t nq, int64_t cap, const uint16_t *v_cache,
                                const int64_t *slots, int64_t p_start, int64_t n, int64_t pos_stride, int64_t off,
                                int dh, float *acc) {
    for (int64_t q0 = 0; q0 < nq; q0 += 4) {
        int m = (int)(nq - q0 < 4 ? nq - q0 : 4);
        const float *wq = w + q0 * cap;
        float *aq = acc + q0 * dh;
        for (int64_t c0 = 0; c0 < dh; c0 += (dh - c0 >= 64 ? 64 : 32)) {
            const uint16_t *vc = v_cache + off;
            if (dh - c0 >= 64) {
                switch (m) {
                    case 1: pv_chunk(wq, cap, 1, 4, vc, slots, p_start, n, pos_stride, c0, aq, dh); break;
                    case 2: pv_chunk(wq, cap, 2, 4, vc, slots, p_start, n, pos_stride, c0, aq, dh); break;
                    case 3: pv_chunk(wq, cap, 3, 4, vc, slots, p_start, n, pos_stride, c0, aq, dh); break;
                    default: pv_chunk(wq, cap, 4, 4, vc, slots, p_start, n, pos_stride, c0, aq, dh); break;
                }
            } else {
                switch (m) {
                    case 1: pv_chunk(wq, cap, 1, 2, vc, slots, p_start, n, pos_stride, c0, aq, dh); break;
                    case 2: pv_chunk(wq, cap, 2, 2, vc, slots, p_start, n, pos_stride, c0, aq, dh); break;
                    case 3: pv_chunk(wq, cap, 3, 2, vc, slots, p_start, n, pos_stride, c0, aq, dh); break;
                    default: pv_chunk(wq, cap, 4, 2, vc, slots, p_start, n, pos_stride, c0, aq, dh); break;
                }
            }
        }
    }
}

typedef struct {
    int64_t cost, block;     // rows x positions a block of rows reads; its index
} block_cost;

static int dearer_first(const void *a, const void *b) {
    int64_t x = ((const block_cost *)a)->cost, y = ((const block_cost *)b)->cost;
    return x < y ? 1 : x > y ? -1 : 0;
}

void upesi_paged_attention(const void *q, int64_t q_stride, void *out, int64_t out_stride, const void *k_cache,
                           const void *v_cache, const int64_t *block_tables, int64_t mb, int bs,
                           const int64_t *rows, const int64_t *blocks, int64_t nblocks, int h, int kvh, int dh,
                           float scale, int bf16, int64_t max_len, int64_t max_rows, int64_t window,
                           float softcap) {
    int g = h / kvh, dv = dh / 8, fast = bf16 && use_avx512 && dh % 32 == 0;   // dh: a multiple of 8 (the caller)
    // Work items: (block of rows, kv head), each over its query heads; with fewer items than two per thread (one
    // sequence's step) each of a kv head's query heads is an item of its own. Every row and head is computed
    // alone either way (the split changes no result, only which thread computes it).
    int parts = nblocks * kvh < 2 * omp_get_max_threads() ? g : 1, ng = g / parts;
    int64_t work = nblocks * kvh * parts, cap = (max_len > 0 ? max_len : 1) + 8;
    // Items go to the threads dearest first (rows x positions they read), each to the thread with the least so far:
    // in the order of the rows, a long prompt chunk's blocks beside decodes left one thread waiting on the other.
    int nt = work > 1 ? omp_get_max_threads() : 1;
    block_cost *order = malloc(sizeof(block_cost) * (size_t)(nblocks > 0 ? nblocks : 1));
    int *owner = malloc(sizeof(int) * (size_t)(work > 0 ? work : 1));
    int64_t *load = calloc((size_t)nt, sizeof(int64_t));
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t *d = rows + blocks[b * 2] * 5;
        order[b] = (block_cost){blocks[b * 2 + 1] * (d[2] + d[(blocks[b * 2 + 1] - 1) * 5 + 3] + 1), b};
    }
    qsort(order, (size_t)nblocks, sizeof(block_cost), dearer_first);
    for (int64_t w = 0; w < work; w++) {
        int least = 0;
        for (int i = 1; i < nt; i++) least = load[i] < load[least] ? i : least;
        owner[w] = least;
        load[least] += order[w / (kvh * parts)].cost / parts + 1;
    }
    #pragma omp parallel num_threads(nt) if (work > 1)
    {
        // per row of a block and head: scores over the block's positions [rows, G, cap], q [rows, G, Dh], acc
        float *scores = malloc(sizeof(float) * (size_t)(max_rows * g * cap));
        float *qv = malloc(sizeof(float) * (size_t)(max_rows * g * dh));
        float *acc = malloc(sizeof(float) * (size_t)(max_rows * g * dh));
        uint16_t *qb = malloc(sizeof(uint16_t) * (size_t)(max_rows * g * dh));   // bf16 q rows (the fast path)
        float *kept = malloc(sizeof(float) * (size_t)cap);
        unsigned char *on = malloc((size_t)cap);                // a tree row: which positions it attends
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)cap);
        float kv[8 * 512];
        int me = omp_get_thread_num();
        for (int64_t w = 0; w < work; w++) {
            if (owner[w] != me)
                continue;
            const int64_t *blk = blocks + order[w / (kvh * parts)].block * 2;   // (first row descriptor, rows): one
            const int64_t *d0 = rows + blk[0] * 5;               // sequence's rows (row, seq, ctx, j, bits)
            int64_t nr = blk[1], ctx = d0[2], last_j = 0;
            int grp = (int)(w / parts % kvh), h0 = grp * g + (int)(w % parts) * ng;   // kv head, first query head
            for (int64_t r = 0; r < nr; r++) last_j = d0[r * 5 + 3] > last_j ? d0[r * 5 + 3] : last_j;
            const int64_t *table = block_tables + d0[1] * mb;
            int64_t n = ctx + last_j + 1, npad = (n + 7) / 8 * 8;   // the positions any row of the block attends
            // a sliding window: row r attends positions >= lo[r] only (its position less window - 1), and the
            // tiles before every row's window are skipped
            int64_t lo[65], p_start = n;
            for (int64_t r = 0; r < nr; r++) {
                uint64_t rb = (uint64_t)d0[r * 5 + 4];
                int64_t pos = ctx + (rb == ~(uint64_t)0 ? d0[r * 5 + 3] : __builtin_popcountll(rb));
                lo[r] = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                p_start = lo[r] < p_start ? lo[r] : p_start;
            }
            p_start = p_start / 8 * 8;
            for (int64_t p = 0, b = 0; p < n; b++) {
                int64_t base = table[b] * bs;
                for (int o = 0; o < bs && p < n; o++) slots[p++] = base + o;
            }
            for (int64_t r = 0; r < nr && !fast; r++)               // fp32 q rows (the fast path reads bf16)
                for (int e = 0; e < ng; e++)
                    load_row(q, d0[r * 5] * q_stride + (int64_t)(h0 + e) * dh, dh, bf16, qv + (r * ng + e) * dh);
            // scores, 8 positions at a time, each K row read once for all rows: every position's q . k is its own
            // 8 lanes (fused multiply-adds over the head dim in order) summed by one tree, whatever the chunk
            if (fast) {
                for (int64_t r = 0; r < nr; r++)
                    memcpy(qb + r * ng * dh, (const uint16_t *)q + d0[r * 5] * q_stride + (int64_t)h0 * dh,
                           sizeof(uint16_t) * (size_t)(ng * dh));
                scores_dpbf16(qb, nr * ng, (const uint16_t *)k_cache, slots, p_start, n, npad, kvh, grp, dh, scale,
                              scores, cap);
                if (softcap > 0.f)
                    for (int64_t re = 0; re < nr * ng; re++)
                        for (int64_t p0 = p_start; p0 < npad; p0 += 8)
                            _mm256_storeu_ps(scores + re * cap + p0,
                                             softcap8(_mm256_loadu_ps(scores + re * cap + p0), softcap));
            } else {
                for (int64_t p0 = p_start; p0 < npad; p0 += 8) {
                    load_tile(k_cache, slots, p0, n, kvh, grp, dh, bf16, kv);
                    for (int64_t re = 0; re < nr * ng; re++) {
                        __m256 s8 = _mm256_mul_ps(dot_tile(qv + re * dh, kv, dh), _mm256_set1_ps(scale));
                        _mm256_storeu_ps(scores + re * cap + p0, softcap > 0.f ? softcap8(s8, softcap) : s8);
                    }
                }
            }
            // softmax of each row and head over the positions it attends; the others weigh 0 below
            for (int64_t r = 0; r < nr; r++) {
                int64_t j = d0[r * 5 + 3], end = ctx + j + 1, l0 = lo[r];   // a causal row attends [l0, end)
                uint64_t bits = (uint64_t)d0[r * 5 + 4];
                int causal = bits == ~(uint64_t)0;
                for (int e = 0; e < ng; e++) {
                    float *sc = scores + (r * ng + e) * cap, m = -INFINITY;
                    if (causal) {
                        __m256 mx = _mm256_set1_ps(-INFINITY);
                        int64_t p = l0;
                        for (; p + 8 <= end; p += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + p));
                        float lanes[8];
                        _mm256_storeu_ps(lanes, mx);
                        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
                        for (; p < end; p++) m = sc[p] > m ? sc[p] : m;
                    } else {                   // a tree: its k-th attended new token sits at position ctx + k
                        for (int64_t p = p_start < ctx ? p_start : ctx, k = 0; p < npad; p++) {   // k from the root
                            int in = p < end && attends(p, ctx, j, bits);
                            if (in && p >= ctx) in = ctx + k++ >= l0;
                            else if (in) in = p >= l0;
                            on[p] = (unsigned char)in;
                            if (in && sc[p] > m) m = sc[p];
                        }
                    }
                    __m256 mv = _mm256_set1_ps(m);
                    for (int64_t p = p_start; p < npad; p += 8)
                        _mm256_storeu_ps(sc + p, exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + p), mv)));
                    float total;
                    if (causal) {
                        total = ordered_sum(sc + l0, end - l0);
                        for (int64_t p = p_start; p < l0; p++) sc[p] = 0.f;
                        for (int64_t p = end; p < npad; p++) sc[p] = 0.f;
                    } else {                                   // the attended scores side by side, in order
                        int64_t kn = 0;
                        for (int64_t p = p_start; p < npad; p++) {
                            if (on[p]) kept[kn++] = sc[p];
                            else sc[p] = 0.f;
                        }
                        total = ordered_sum(kept, kn);
                    }
                    __m256 inv = _mm256_set1_ps(1.f / total);
                    for (int64_t p = p_start; p < npad; p += 8)
                        _mm256_storeu_ps(sc + p, _mm256_mul_ps(_mm256_loadu_ps(sc + p), inv));
                }
            }
            // weighted sum of V, 8 positions at a time, each V row read once: every output lane adds its
            // positions' products in position order (a position a row does not attend adds 0 x v)
            memset(acc, 0, sizeof(float) * (size_t)(nr * ng * dh));
            if (fast) {
                pv_bf16(scores, nr * ng, cap, (const uint16_t *)v_cache, slots, p_start, n, (int64_t)kvh * dh,
                        (int64_t)grp * dh, dh, acc);
            } else for (int64_t p0 = p_start; p0 < npad; p0 += 8) {
                load_tile(v_cache, slots, p0, n, kvh, grp, dh, bf16, kv);
                int cnt = (int)(n - p0 < 8 ? n - p0 : 8);
                for (int64_t re = 0; re < nr * ng; re++) {
                    const float *wr = scores + re * cap + p0;
                    float *a = acc + re * dh;
                    int x = 0;
                    for (; x + 8 <= dv; x += 8) axpy_tile8(a + 8 * x, wr, kv + 8 * x, dh, cnt);
                    for (; x < dv; x++) axpy_tile1(a + 8 * x, wr, kv + 8 * x, dh, cnt);
                }
            }
            for (int64_t r = 0; r < nr; r++)
                for (int e = 0; e < ng; e++)
                    store_row(out, d0[r * 5] * out_stride + (int64_t)(h0 + e) * dh, dh, bf16,
                              acc + (r * ng + e) * dh);
        }
        free(scores);
        free(qv);
        free(acc);
        free(qb);
        free(kept);
        free(on);
        free(slots);
    }
    free(order);
    free(owner);
    free(load);
}
