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
        float lane[16] = {0}, row[8192];
        int64_t dd = d < 8192 ? d : 8192;
        for (int64_t i = 0; i < dd; i++)
            row[i] = bf16 ? bf16_to_f32(((const uint16_t *)x)[r * ldx + i]) : ((const float *)x)[r * ldx + i];
        int64_t i = 0;
        for (; i + 16 <= dd; i += 16)
            for (int l = 0; l < 16; l++) lane[l] = fmaf(row[i + l], row[i + l], lane[l]);
        float ss = 0.f;
        for (; i < dd; i++) ss = fmaf(row[i], row[i], ss);
        for (int l = 0; l < 16; l++) ss += lane[l];
        float inv = 1.f / sqrtf(ss / (float)d + eps);
        for (int64_t k = 0; k < dd; k++) {
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
