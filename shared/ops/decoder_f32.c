// A Llama-style decoder stack for a step's few fp32 rows in one call, on x86-64 CPUs with AVX2 and FMA whose linear
// layers are block-quantised (shared/ops/decoder_f32.py loads this). The fp32 twin of decoder_bf16.c: layer after
// layer it calls the kernels the model's modules call one by one from Python (RMSNorm, qgemm_avx2.c's GEMM, RoPE +
// KV store, paged attention), through function pointers into their own libraries, and does the residual adds and
// SwiGLU's silu(gate) * up here; the module path calls this file's silu_mul too, so both paths compute the same
// operations and their results are equal bit for bit.
// Shapes: T = rows, D = hidden, H / KVH = query / kv heads, Dh = head dim, I = intermediate, L = layers.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "decoder_layout.h"
#include "exp_avx2.h"

typedef void (*gemm_fn)(const float *, int64_t, int64_t, int64_t, const int64_t *, const float *, int64_t, float *,
                        int64_t, int);

// (g / (1 + e^-g)) * u, rounded after the division and the product.
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    __m256 e = exp8_any(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

// gu [T, 2I] (gate, then up, rows ld apart) -> out [T, I]: (gate / (1 + e^-gate)) * up, rounded after the
// division and the product as torch's F.silu(gate) * up rounds (its exp may differ in the last bit).
void upesi_silu_mul_f32(const float *gu, int64_t t, int64_t ld, int64_t inter, float *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && t > 1 && t * inter >= 8192)
    for (int64_t r = 0; r < t; r++) {
        const float *g = gu + r * ld, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
        }
        if (i < inter) {                                     // the tail through a padded vector: the same steps
            float gt[8] = {0}, ut[8] = {0}, ot[8];
            for (int64_t j = i; j < inter; j++) {
                gt[j - i] = g[j];
                ut[j - i] = u[j];
            }
            _mm256_storeu_ps(ot, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
            for (int64_t j = i; j < inter; j++)
                o[j] = ot[j - i];
        }
    }
}

// x [n] += a [n] (fp32 adds, as torch's).
static void add_rows(float *x, const float *a, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(a + i)));
    for (; i < n; i++)
        x[i] += a[i];
}

// x [T, D] fp32, in place: the residual stream after every layer (before the final norm). The arguments are
// decoder_bf16.c's, with fp32 rows, cos, sin and caches; chunks go to prefill_attention_f32.c (fns[F_PREFILL]).
void upesi_decoder_f32(const int64_t *fns, const int64_t *dims, const int64_t *layers, float eps, float scale,
                       float *x, int64_t t, const float *cos, const float *sin, const int64_t *slots,
                       const int64_t *block_tables, int64_t mb, const int64_t *rows, const int64_t *blocks,
                       int64_t nblocks, int64_t max_len, int64_t max_rows, const int64_t *chunks,
                       int64_t nchunks) {
    norm_fn norm = (norm_fn)fns[F_NORM];
    rope_fn rope = (rope_fn)fns[F_ROPE];
    attn_fn attn = (attn_fn)fns[F_ATTN];
    prefill_f32_fn prefill = (prefill_f32_fn)fns[F_PREFILL];
    int64_t d = dims[D_HIDDEN], inter = dims[D_INTER];
    int h = (int)dims[D_HEADS], kvh = (int)dims[D_KV_HEADS], dh = (int)dims[D_HEAD_DIM], bs = (int)dims[D_BLOCK];
    int threads = (int)dims[D_THREADS], rot = (int)dims[D_ROTARY];
    int64_t nqkv = (int64_t)(h + 2 * kvh) * dh, nq = (int64_t)h * dh;
    float *nx = malloc(sizeof(float) * (size_t)(t * d));                   // normed rows [T, D]
    float *qkv = malloc(sizeof(float) * (size_t)(t * nqkv));               // [T, (H + 2 KVH) Dh]
    float *o = malloc(sizeof(float) * (size_t)(t * nq));                   // [T, H Dh]
    float *a = malloc(sizeof(float) * (size_t)(t * d));                    // a sublayer's output [T, D]
    float *gu = malloc(sizeof(float) * (size_t)(t * 2 * inter));           // [T, 2I]
    float *act = malloc(sizeof(float) * (size_t)(t * inter));              // [T, I]
    for (int64_t l = 0; l < dims[D_LAYERS]; l++) {
        const int64_t *w = layers + l * PER_LAYER;
        gemm_fn g_qkv = (gemm_fn)w[G_QKV], g_o = (gemm_fn)w[G_O], g_gu = (gemm_fn)w[G_GU], g_down = (gemm_fn)w[G_DOWN];
        norm(x, t, d, d, (const void *)w[W_NORM1], eps, nx, 0);
        g_qkv(nx, t, d, d, (const int64_t *)w[W_QKV], (const float *)w[B_QKV], nqkv, qkv, nqkv, threads);
        rope(qkv, t, nqkv, h, kvh, dh, rot, cos, sin, (void *)w[K_CACHE], (void *)w[V_CACHE], slots, 0);
        attn(qkv, nqkv, o, nq, (const void *)w[K_CACHE], (const void *)w[V_CACHE], block_tables, mb, bs, rows,
             blocks, nblocks, h, kvh, dh, scale, 0, max_len, max_rows, w[WINDOW], 0.f);
        for (int64_t c = 0; c < nchunks; c++) {      // its head size was checked before (it returns 0)
            const int64_t *ch = chunks + 4 * c;
            prefill(qkv + ch[1] * nqkv, nqkv, o + ch[1] * nq, nq, (const float *)w[K_CACHE], (const float *)w[V_CACHE],
                    block_tables + ch[0] * mb, bs, ch[2], ch[3], h, kvh, dh, scale, w[WINDOW], threads);
        }
        g_o(o, t, nq, nq, (const int64_t *)w[W_O], (const float *)w[B_O], d, a, d, threads);
        add_rows(x, a, t * d);
        norm(x, t, d, d, (const void *)w[W_NORM2], eps, nx, 0);
        g_gu(nx, t, d, d, (const int64_t *)w[W_GU], (const float *)w[B_GU], 2 * inter, gu, 2 * inter, threads);
        upesi_silu_mul_f32(gu, t, 2 * inter, inter, act, threads);
        g_down(act, t, inter, inter, (const int64_t *)w[W_DOWN], (const float *)w[B_DOWN], d, a, d, threads);
        add_rows(x, a, t * d);
    }
    free(nx); free(qkv); free(o); free(a); free(gu); free(act);
}
