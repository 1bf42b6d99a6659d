// A Llama-style decoder stack for a step's few rows in one call, bf16 on CPUs with AVX512-BF16
// (shared/ops/decoder_bf16.py loads this). It runs, layer after layer, the same kernels the model's modules call one
// by one from Python (RMSNorm, the bf16 rows GEMM, RoPE + KV store, paged attention), reached through function
// pointers into their own libraries, plus the residual adds and SwiGLU's silu(gate) * up done here. Each step is
// rounded to bf16 where the module path rounds, so the result equals the module path bit for bit.
// Shapes: T = rows, D = hidden, H / KVH = query / kv heads, Dh = head dim, I = intermediate, L = layers.
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "bf16_512.h"
#include "decoder_layout.h"

typedef void (*gemm_fn)(const uint16_t *, int64_t, int64_t, int64_t, const uint16_t *, const uint16_t *, int64_t,
                        uint16_t *, int64_t, int);
// gemm_fn's call for a gate_up weight [2 I, K] whose output is silu(gate) * up [T, I] (I as n), and the silu table
typedef void (*swiglu_fn)(const uint16_t *, int64_t, int64_t, int64_t, const uint16_t *, const uint16_t *, int64_t,
                          uint16_t *, int64_t, int, const uint16_t *);

// round(silu(g)) for every bf16 gate g, by its bits: g / (1 + expf(-g)) in fp32 as torch computes it (its exp may
// differ from glibc's in the last fp32 bit), rounded to bf16. A lookup gives a row its activations at a third of
// the time of computing them (2 more entries: a 4-byte gather of the last stays inside).
static uint16_t silu_table[65536 + 2];
static pthread_once_t silu_once = PTHREAD_ONCE_INIT;

static void fill_silu_table(void) {
    for (int b = 0; b < 65536; b++) {
        float g = bf16_to_f32((uint16_t)b);
        silu_table[b] = f32_to_bf16(g / (1.f + expf(-g)));
    }
}

// The table, filled at first use, for callers that apply it themselves (qgemm_amx_wide.c's fused gate_up GEMM).
const uint16_t *upesi_silu_table(void) {
    pthread_once(&silu_once, fill_silu_table);
    return silu_table;
}

// gu [T, 2I] (gate, then up, rows ld apart) -> out [T, I]: round(round(silu(gate)) * up), as torch's
// F.silu(gate) * up on bf16 tensors rounds.
// Rows are split between `threads` threads when there are several (each element is computed alone).
void upesi_silu_mul_bf16(const uint16_t *gu, int64_t t, int64_t ld, int64_t inter, uint16_t *out, int threads) {
    pthread_once(&silu_once, fill_silu_table);
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && t > 1 && t * inter >= 8192)
    for (int64_t r = 0; r < t; r++)
        for (int64_t i = 0; i < inter; i += 16) {
            __mmask16 m = mask16(inter - i);
            __m512i gate = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, gu + r * ld + i));
            __m512i s = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, gate, (const int *)silu_table, 2);
            __m512 u = bf16x16_load(gu + r * ld + inter + i, m);
            bf16x16_store(out + r * inter + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(s, 16)), u), m);
        }
}

// x [T, D] += a [T, D], rounded to bf16 (torch's bf16 add); split between `threads` threads when long.
static void add_rows(uint16_t *x, const uint16_t *a, int64_t n, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 8192)
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = mask16(n - i);
        bf16x16_store(x + i, _mm512_add_ps(bf16x16_load(x + i, m), bf16x16_load(a + i, m)), m);
    }
}

// x [T, D] bf16, in place: the residual stream after every layer (before the final norm).
// fns [5]: the kernels (F_*); dims [9]; layers [L, PER_LAYER] pointers (biases may be 0), the layer's sliding window
// (0: none) and its GEMMs; cos, sin [T, R] bf16 (R = dims[D_ROTARY], the rotated dims of a head: Dh, or fewer);
// slots [T]; block_tables [B, MB]; rows [R, 5] and blocks [NB, 2]: shared.ops.cpu_attention's descriptors of the
// rows the row kernel takes; chunks [NC, 4] (sequence, first row, rows, positions after the step): prompt chunks
// the prefill kernel (fns[F_PREFILL]) takes instead.
void upesi_decoder_bf16(const int64_t *fns, const int64_t *dims, const int64_t *layers, float eps, float scale,
                        uint16_t *x, int64_t t, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                        const int64_t *block_tables, int64_t mb, const int64_t *rows, const int64_t *blocks,
                        int64_t nblocks, int64_t max_len, int64_t max_rows, const int64_t *chunks, int64_t nchunks) {
    norm_fn norm = (norm_fn)fns[F_NORM];
    add_norm_fn add_norm = (add_norm_fn)fns[F_ADD_NORM];
    rope_fn rope = (rope_fn)fns[F_ROPE];
    attn_fn attn = (attn_fn)fns[F_ATTN];
    prefill_fn prefill = (prefill_fn)fns[F_PREFILL];
    int64_t d = dims[D_HIDDEN], inter = dims[D_INTER];
    int h = (int)dims[D_HEADS], kvh = (int)dims[D_KV_HEADS], dh = (int)dims[D_HEAD_DIM], bs = (int)dims[D_BLOCK];
    int threads = (int)dims[D_THREADS], rot = (int)dims[D_ROTARY];
    int64_t nqkv = (int64_t)(h + 2 * kvh) * dh, nq = (int64_t)h * dh;
    uint16_t *nx = malloc(sizeof(uint16_t) * (size_t)(t * d));            // normed rows [T, D]
    uint16_t *qkv = malloc(sizeof(uint16_t) * (size_t)(t * nqkv));        // [T, (H + 2 KVH) Dh]
    uint16_t *o = malloc(sizeof(uint16_t) * (size_t)(t * nq));            // [T, H Dh]
    uint16_t *a = malloc(sizeof(uint16_t) * (size_t)(t * d));             // a sublayer's output [T, D]
    uint16_t *gu = malloc(sizeof(uint16_t) * (size_t)(t * 2 * inter));    // [T, 2I]
    uint16_t *act = malloc(sizeof(uint16_t) * (size_t)(t * inter));       // [T, I]
    for (int64_t l = 0; l < dims[D_LAYERS]; l++) {
        const int64_t *w = layers + l * PER_LAYER;
        if (l == 0)
            norm(x, t, d, d, (const void *)w[W_NORM1], eps, nx, 1);
        else                                         // the previous layer's MLP output added, then this norm
            add_norm(x, a, t, d, (const void *)w[W_NORM1], eps, x, nx, 1);
        gemm_fn g_qkv = (gemm_fn)w[G_QKV], g_o = (gemm_fn)w[G_O], g_gu = (gemm_fn)w[G_GU], g_down = (gemm_fn)w[G_DOWN];
        g_qkv(nx, t, d, d, (const uint16_t *)w[W_QKV], (const uint16_t *)w[B_QKV], nqkv, qkv, nqkv, threads);
        rope(qkv, t, nqkv, h, kvh, dh, rot, cos, sin, (void *)w[K_CACHE], (void *)w[V_CACHE], slots, 1);
        if (nblocks)                                 // a prefill's chunk alone has no rows for it
            attn(qkv, nqkv, o, nq, (const void *)w[K_CACHE], (const void *)w[V_CACHE], block_tables, mb, bs, rows,
                 blocks, nblocks, h, kvh, dh, scale, 1, max_len, max_rows, w[WINDOW], 0.f);
        for (int64_t c = 0; c < nchunks; c++) {      // its head size was checked before (it returns 0)
            const int64_t *ch = chunks + 4 * c;
            prefill(qkv + ch[1] * nqkv, nqkv, o + ch[1] * nq, nq, (const uint16_t *)w[K_CACHE],
                    (const uint16_t *)w[V_CACHE], block_tables + ch[0] * mb, bs, ch[2], ch[3], h, kvh, dh, scale,
                    w[WINDOW], threads);
        }
        g_o(o, t, nq, nq, (const uint16_t *)w[W_O], (const uint16_t *)w[B_O], d, a, d, threads);
        add_norm(x, a, t, d, (const void *)w[W_NORM2], eps, x, nx, 1);
        if (w[G_GU_ACT]) {
            ((swiglu_fn)w[G_GU_ACT])(nx, t, d, d, (const uint16_t *)w[W_GU], (const uint16_t *)w[B_GU], inter, act,
                                     inter, threads, upesi_silu_table());
        } else {
            g_gu(nx, t, d, d, (const uint16_t *)w[W_GU], (const uint16_t *)w[B_GU], 2 * inter, gu, 2 * inter,
                 threads);
            upesi_silu_mul_bf16(gu, t, 2 * inter, inter, act, threads);
        }
        g_down(act, t, inter, inter, (const uint16_t *)w[W_DOWN], (const uint16_t *)w[B_DOWN], d, a, d, threads);
    }
    add_rows(x, a, t * d, threads);                  // the last layer's MLP output
    free(nx); free(qkv); free(o); free(a); free(gu); free(act);
}
