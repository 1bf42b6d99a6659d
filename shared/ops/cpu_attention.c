// Paged attention and RoPE + KV store for CPUs, fp32 or bf16 (shared/ops/cpu_attention.py loads this with ctypes).
//
// Shapes: T = rows of the step, H / KVH = query / kv heads, G = H / KVH, Dh = head dim, BS = block size,
// MB = max blocks per sequence, P = rope table positions.
//
// upesi_rope_store: qkv [T, (H + 2 KVH) Dh] (rows `row_stride` apart), cos / sin [T, Dh] in the same dtype ->
// q and k rotated in place ("rotate half",
// as the torch path: x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype, no fused
// multiply-add), then k and v stored at their cache slots.
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"


static inline void load_row(const void *base, int64_t off, int n, int bf16, float *dst) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, (const float *)base + off, (size_t)n * 4);
    }
}

static inline void store_row(void *base, int64_t off, int n, int bf16, const float *src) {
    if (bf16) {
        uint16_t *d = (uint16_t *)base + off;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)base + off, src, (size_t)n * 4);
    }
}

// One head [Dh] rotated in place by this row's cos / sin [Dh] (values of the dtype, so no rounding of them here).
static void rope_head(float *x, const float *cos, const float *sin, int dh, int bf16) {
    int half = dh / 2;
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

void upesi_rope_store(void *qkv, int64_t t, int64_t row_stride, int h, int kvh, int dh, const void *cos,
                      const void *sin, void *k_cache, void *v_cache, const int64_t *slots, int bf16) {
    #pragma omp parallel for schedule(static) if (t > 1)
    for (int64_t r = 0; r < t; r++) {
        float x[512], c[512], s[512];
        load_row(cos, r * dh, dh, bf16, c);
        load_row(sin, r * dh, dh, bf16, s);
        int64_t base = r * row_stride;
        for (int hh = 0; hh < h + kvh; hh++) {                   // q heads, then k heads
            int64_t off = base + (int64_t)hh * dh;
            load_row(qkv, off, dh, bf16, x);
            rope_head(x, c, s, dh, bf16);
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

// e^x for x <= 0 (scores minus their maximum), Cephes' polynomial after x = n ln2 + r; under -87.3 it clamps.
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Whether a row (ctx, j, bits) attends position p of its sequence.
static inline int attends(int64_t p, int64_t ctx, int64_t j, uint64_t bits) {
    if (p < ctx) return 1;
    int64_t i = p - ctx;
    return i <= j && (i == 0 || ((bits >> (i - 1)) & 1u));
}

void upesi_paged_attention(const void *q, int64_t q_stride, void *out, int64_t out_stride, const void *k_cache,
                           const void *v_cache, const int64_t *block_tables, int64_t mb, int bs,
                           const int64_t *rows, const int64_t *blocks, int64_t nblocks, int h, int kvh, int dh,
                           float scale, int bf16, int64_t max_len, int64_t max_rows) {
    int g = h / kvh, dv = dh / 8;                               // dh is a multiple of 8 (checked by the caller)
    int64_t work = nblocks * kvh, cap = (max_len > 0 ? max_len : 1) + 8;
    #pragma omp parallel if (work > 1)
    {
        // per row of a block and head: scores over the block's positions [rows, G, cap], q [rows, G, Dh], acc
        float *scores = malloc(sizeof(float) * (size_t)(max_rows * g * cap));
        float *qv = malloc(sizeof(float) * (size_t)(max_rows * g * dh));
        float *acc = malloc(sizeof(float) * (size_t)(max_rows * g * dh));
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)cap);
        float kv[8 * 512];
        #pragma omp for schedule(static)
        for (int64_t w = 0; w < work; w++) {
            const int64_t *blk = blocks + (w / kvh) * 2;         // (first row descriptor, rows): one sequence's
            const int64_t *d0 = rows + blk[0] * 5;               // rows (row, seq, ctx, j, bits), same ctx
            int64_t nr = blk[1], ctx = d0[2], last_j = 0;
            int grp = (int)(w % kvh);
            for (int64_t r = 0; r < nr; r++) last_j = d0[r * 5 + 3] > last_j ? d0[r * 5 + 3] : last_j;
            const int64_t *table = block_tables + d0[1] * mb;
            int64_t n = ctx + last_j + 1, npad = (n + 7) / 8 * 8;   // the positions any row of the block attends
            for (int64_t p = 0; p < n; p++) slots[p] = slot_of(table, p, bs);
            for (int64_t r = 0; r < nr; r++)
                for (int e = 0; e < g; e++)
                    load_row(q, d0[r * 5] * q_stride + (int64_t)(grp * g + e) * dh, dh, bf16, qv + (r * g + e) * dh);
            // scores, 8 positions at a time, each K row read once for all rows: every position's q . k is its own
            // 8 lanes summed by one tree, whatever the chunk it falls in
            for (int64_t p0 = 0; p0 < npad; p0 += 8) {
                for (int i = 0; i < 8; i++) {
                    if (p0 + i < n) load_row(k_cache, (slots[p0 + i] * kvh + grp) * dh, dh, bf16, kv + i * dh);
                    else memset(kv + i * dh, 0, sizeof(float) * (size_t)dh);
                }
                for (int64_t re = 0; re < nr * g; re++) {
                    __m256 part[8];
                    for (int i = 0; i < 8; i++) {
                        __m256 a = _mm256_setzero_ps();
                        for (int x = 0; x < dv; x++)
                            a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + re * dh + 8 * x),
                                                _mm256_loadu_ps(kv + i * dh + 8 * x), a);
                        part[i] = a;
                    }
                    _mm256_storeu_ps(scores + re * cap + p0, _mm256_mul_ps(hsum8(part), _mm256_set1_ps(scale)));
                }
            }
            // softmax of each row and head over the positions it attends, summed one by one in order
            for (int64_t r = 0; r < nr; r++) {
                int64_t j = d0[r * 5 + 3];
                uint64_t bits = (uint64_t)d0[r * 5 + 4];
                for (int e = 0; e < g; e++) {
                    float *sc = scores + (r * g + e) * cap, m = -INFINITY, total = 0.f;
                    for (int64_t p = 0; p < n; p++)
                        if (attends(p, ctx, j, bits) && sc[p] > m) m = sc[p];
                    __m256 mv = _mm256_set1_ps(m);
                    for (int64_t p = 0; p < npad; p += 8)
                        _mm256_storeu_ps(sc + p, exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + p), mv)));
                    for (int64_t p = 0; p < n; p++) {
                        if (attends(p, ctx, j, bits)) total += sc[p];
                        else sc[p] = 0.f;                      // weighs nothing below
                    }
                    float inv = 1.f / total;
                    for (int64_t p = 0; p < n; p++) sc[p] *= inv;
                }
            }
            memset(acc, 0, sizeof(float) * (size_t)(nr * g * dh));
            for (int64_t p = 0; p < n; p++) {                   // each V row read once, added in position order
                load_row(v_cache, (slots[p] * kvh + grp) * dh, dh, bf16, kv);
                for (int64_t r = 0; r < nr; r++) {
                    if (!attends(p, ctx, d0[r * 5 + 3], (uint64_t)d0[r * 5 + 4])) continue;
                    for (int e = 0; e < g; e++) {
                        __m256 wgt = _mm256_set1_ps(scores[(r * g + e) * cap + p]);
                        float *a = acc + (r * g + e) * dh;
                        for (int x = 0; x < dv; x++)
                            _mm256_storeu_ps(a + 8 * x, _mm256_fmadd_ps(wgt, _mm256_loadu_ps(kv + 8 * x),
                                                                        _mm256_loadu_ps(a + 8 * x)));
                    }
                }
            }
            for (int64_t r = 0; r < nr; r++)
                for (int e = 0; e < g; e++)
                    store_row(out, d0[r * 5] * out_stride + (int64_t)(grp * g + e) * dh, dh, bf16,
                              acc + (r * g + e) * dh);
        }
        free(scores);
        free(qv);
        free(acc);
        free(slots);
    }
}
