// RMSNorm on CPU, fp32 or bf16 (shared/ops/rms_norm.py loads this with ctypes).
//
// y = w * round(x * rsqrt(mean(x^2) + eps)), computed as the torch path of shared.model.llama.RMSNorm does (and
// Hugging Face's): in fp32, the normalised row rounded to the dtype, then multiplied by the weight in the dtype.
// The sum of squares runs in 16 fp32 lanes added in a fixed order, so a row's result does not depend on the other
// rows. upesi_add_rms_norm first adds the residual, s = round(x + a) as torch's add in the dtype, writes s and
// normalises it. An AVX-512 path (16 lanes in one register) and the AVX2 one (two registers of 8) compute the same
// lanes in the same order, so they agree bit for bit. Shapes: T = rows, D = features.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "bf16_512.h"

static int use_avx512 = -1;            // -1: where the CPU has it

// Chooses the path: 1 AVX-512 where the CPU has it, 0 AVX2; returns whether AVX-512 runs.
int upesi_rms_norm_avx512(int on) { return avx512_choose(&use_avx512, on); }

// One row on AVX2: x [D] (and a [D], the residual, with s [D] its sum out, or a = 0) -> y [D].
static void norm_row_avx2(const void *x, const void *a, void *s, int64_t d, const void *w, float eps, void *y,
                          int bf16) {
    float lane[16], row[8192], add[8192];
    if (bf16)
        bf16_row_to_f32((const uint16_t *)x, d, row);
    else
        memcpy(row, x, (size_t)d * 4);
    if (a) {
        if (bf16) {
            bf16_row_to_f32((const uint16_t *)a, d, add);
            for (int64_t i = 0; i < d; i++) row[i] += add[i];
            f32_row_to_bf16(row, d, (uint16_t *)s);
            bf16_row_to_f32((const uint16_t *)s, d, row);                  // the sum as rounded
        } else {
            for (int64_t i = 0; i < d; i++) row[i] += ((const float *)a)[i];
            memcpy(s, row, (size_t)d * 4);
        }
    }
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();           // lanes 0-7 and 8-15
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        __m256 x0 = _mm256_loadu_ps(row + i), x1 = _mm256_loadu_ps(row + i + 8);
        a0 = _mm256_fmadd_ps(x0, x0, a0);
        a1 = _mm256_fmadd_ps(x1, x1, a1);
    }
    _mm256_storeu_ps(lane, a0);
    _mm256_storeu_ps(lane + 8, a1);
    float ss = 0.f;
    for (; i < d; i++) ss = fmaf(row[i], row[i], ss);
    for (int l = 0; l < 16; l++) ss += lane[l];
    float inv = 1.f / sqrtf(ss / (float)d + eps);
    int64_t k = 0;
    if (bf16) {                      // v = row * inv rounded to bf16, times the weight, rounded again: 8 at a time
        const uint16_t *wb = (const uint16_t *)w;
        uint16_t *yb = (uint16_t *)y;
        for (; k + 8 <= d; k += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(row + k), _mm256_set1_ps(inv));
            _mm_storeu_si128((__m128i *)(yb + k),
                             f32x8_to_bf16(_mm256_mul_ps(round_bf16x8(v), bf16x8_to_f32(wb + k))));
        }
    }
    for (; k < d; k++) {
        float v = row[k] * inv;
        if (bf16) {
            float vw = bf16_to_f32(f32_to_bf16(v)) * bf16_to_f32(((const uint16_t *)w)[k]);
            ((uint16_t *)y)[k] = f32_to_bf16(vw);
        } else {
            ((float *)y)[k] = ((const float *)w)[k] * v;
        }
    }
}

// The same row on AVX-512: lane l of the one accumulator is lane l of the AVX2 path's pair.
UPESI_AVX512 static void norm_row_512(const void *x, const void *a, void *s, int64_t d, const void *w, float eps,
                                      void *y, int bf16) {
    __m512 acc = _mm512_setzero_ps();
    int64_t full = d / 16 * 16;
    for (int64_t i = 0; i < d; i += 16) {
        __mmask16 m = mask16(d - i);
        __m512 v = row16_load(x, i, m, bf16);
        if (a) {
            v = _mm512_add_ps(v, row16_load(a, i, m, bf16));
            if (bf16) v = bf16x16_round(v);
            row16_store(s, i, v, m, bf16);
        }
        if (i < full) acc = _mm512_fmadd_ps(v, v, acc);
    }
    const void *src = a ? s : x;
    float lane[16], ss = 0.f;
    for (int64_t i = full; i < d; i++) {
        float v = bf16 ? bf16_to_f32(((const uint16_t *)src)[i]) : ((const float *)src)[i];
        ss = fmaf(v, v, ss);
    }
    _mm512_storeu_ps(lane, acc);
    for (int l = 0; l < 16; l++) ss += lane[l];
    __m512 inv = _mm512_set1_ps(1.f / sqrtf(ss / (float)d + eps));
    for (int64_t k = 0; k < d; k += 16) {
        __mmask16 m = mask16(d - k);
        __m512 v = _mm512_mul_ps(row16_load(src, k, m, bf16), inv);
        if (bf16)
            v = _mm512_mul_ps(bf16x16_round(v), bf16x16_load((const uint16_t *)w + k, m));
        else
            v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, (const float *)w + k), v);
        row16_store(y, k, v, m, bf16);
    }
}

static void norm_rows(const void *x, int64_t ldx, const void *a, void *s, int64_t t, int64_t d, const void *w,
                      float eps, void *y, int bf16) {
    int64_t e = bf16 ? 2 : 4, wide = avx512_chosen(&use_avx512);
    #pragma omp parallel for schedule(static) if (t > 16)
    for (int64_t r = 0; r < t; r++) {
        const char *xr = (const char *)x + r * ldx * e;
        const void *ar = a ? (const char *)a + r * d * e : 0;
        void *sr = a ? (char *)s + r * d * e : 0, *yr = (char *)y + r * d * e;
        if (wide)
            norm_row_512(xr, ar, sr, d, w, eps, yr, bf16);
        else
            norm_row_avx2(xr, ar, sr, d, w, eps, yr, bf16);
    }
}

// x [T, D] (rows ldx apart), w [D], y [T, D] contiguous; all of the dtype (bf16 = 1: bfloat16, else float32).
void upesi_rms_norm(const void *x, int64_t t, int64_t ldx, int64_t d, const void *w, float eps, void *y, int bf16) {
    norm_rows(x, ldx, 0, 0, t, d, w, eps, y, bf16);
}

// x, a [T, D] contiguous -> s = x + a [T, D] (rounded to the dtype) and y = the norm of s [T, D].
void upesi_add_rms_norm(const void *x, const void *a, int64_t t, int64_t d, const void *w, float eps, void *s,
                        void *y, int bf16) {
    norm_rows(x, d, a, s, t, d, w, eps, y, bf16);
}
