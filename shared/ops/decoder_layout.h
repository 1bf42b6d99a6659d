// What decoder_bf16.c and decoder_f32.c read: the kernels they call through function pointers (rms_norm.c,
// cpu_attention.c, prefill_attention.c or prefill_attention_f32.c; their GEMMs' types differ by dtype and stay in
// each file) and the layout of their int64 arrays (shared/ops/decoder_bf16.py's DecoderStack fills them).
#ifndef UPESI_DECODER_LAYOUT_H
#define UPESI_DECODER_LAYOUT_H
#include <stdint.h>

typedef void (*norm_fn)(const void *, int64_t, int64_t, int64_t, const void *, float, void *, int);
typedef void (*add_norm_fn)(const void *, const void *, int64_t, int64_t, const void *, float, void *, void *, int);
typedef void (*rope_fn)(void *, int64_t, int64_t, int, int, int, int, const void *, const void *, void *, void *,
                        const int64_t *, int);
typedef void (*attn_fn)(const void *, int64_t, void *, int64_t, const void *, const void *, const int64_t *, int64_t,
                        int, const int64_t *, const int64_t *, int64_t, int, int, int, float, int, int64_t, int64_t,
                        int64_t, float);
typedef int (*prefill_fn)(const uint16_t *, int64_t, uint16_t *, int64_t, const uint16_t *, const uint16_t *,
                          const int64_t *, int64_t, int64_t, int64_t, int, int, int64_t, float, int64_t, int);
typedef int (*prefill_f32_fn)(const float *, int64_t, float *, int64_t, const float *, const float *, const int64_t *,
                              int64_t, int64_t, int64_t, int, int, int64_t, float, int64_t, int);

// Per layer: the norms, the four linears' weights (bf16 panels, or a quantised weight's descriptor) and biases, the
// caches, the sliding window (0: none), each linear's GEMM and, where one runs (else 0), a gate_up GEMM that writes
// SwiGLU's activation itself (swiglu_fn).
enum { W_NORM1, W_QKV, B_QKV, W_O, B_O, W_NORM2, W_GU, B_GU, W_DOWN, B_DOWN, K_CACHE, V_CACHE, WINDOW, G_QKV, G_O,
       G_GU, G_DOWN, G_GU_ACT, PER_LAYER };
enum { F_NORM, F_ROPE, F_ATTN, F_PREFILL, F_ADD_NORM };           // fns (F_PREFILL: 0 where none runs)
enum { D_LAYERS, D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_BLOCK, D_THREADS, D_ROTARY };   // dims
#endif
