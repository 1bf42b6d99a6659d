// RMSNorm on CPU, fp32 or bf16 (shared/ops/rms_norm.py loads this with ctypes).
//
// y = w * round(x * rsqrt(mean(x^2) + eps)), computed as the torch path of shared.model.llama.RMSNorm does (and
// Hugging Face's): in fp32, the normalised row rounded to the dtype, then multiplied by the weight in the dtype.
// The sum of squares runs in 16 fp32 lanes added in a fixed order, so a row's result does not depend on the other
// rows. Shapes: T = rows, D = features.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"


// x [T, D] (rows ldx apart), w [D], y [T, D] contiguous; all of the dtype (bf16 = 1: bfloat16, else float32).
void upesi_rms_norm(const void *x, int64_t t, int64_t ldx, int64_t d, const void *w, float eps, void *y,
                    int bf16) {
    #pragma omp parallel for schedule(static) if (t > 16)
    for (int64_t r = 0; r < t; r++) {
        float lane[16], row[8192];
        int64_t dd = d < 8192 ? d : 8192;
        if (bf16)
            bf16_row_to_f32((const uint16_t *)x + r * ldx, dd, row);
        else
            memcpy(row, (const float *)x + r * ldx, (size_t)dd * 4);
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();     // lanes 0-7 and 8-15
        int64_t i = 0;
        for (; i + 16 <= dd; i += 16) {
            __m256 x0 = _mm256_loadu_ps(row + i), x1 = _mm256_loadu_ps(row + i + 8);
            a0 = _mm256_fmadd_ps(x0, x0, a0);
            a1 = _mm256_fmadd_ps(x1, x1, a1);
        }
        _mm256_storeu_ps(lane, a0);
        _mm256_storeu_ps(lane + 8, a1);
        float ss = 0.f;
        for (; i < dd; i++) ss = fmaf(row[i], row[i], ss);
        for (int l = 0; l < 16; l++) ss += lane[l];
        float inv = 1.f / sqrtf(ss / (float)d + eps);
        int64_t k = 0;
        if (bf16) {                  // v = row * inv rounded to bf16, times the weight, rounded again: 8 at a time
            const uint16_t *wb = (const uint16_t *)w;
            uint16_t *yb = (uint16_t *)y + r * d;
            for (; k + 8 <= dd; k += 8) {
                __m256 v = _mm256_mul_ps(_mm256_loadu_ps(row + k), _mm256_set1_ps(inv));
                _mm_storeu_si128((__m128i *)(yb + k),
                                 f32x8_to_bf16(_mm256_mul_ps(round_bf16x8(v), bf16x8_to_f32(wb + k))));
            }
        }
        for (; k < dd; k++) {
            float v = row[k] * inv;
            if (bf16) {
                float vw = bf16_to_f32(f32_to_bf16(v)) * bf16_to_f32(((const uint16_t *)w)[k]);
                ((uint16_t *)y)[r * d + k] = f32_to_bf16(vw);
            } else {
                ((float *)y)[r * d + k] = ((const float *)w)[k] * v;
            }
        }
    }
}
