// bf16 <-> fp32 conversions shared by the C kernels of shared/ops (cpu_attention.c, rms_norm.c, decoder_bf16.c);
// with AVX2, whole rows 8 at a time, bit for bit the scalar ones.
#ifndef UPESI_BF16_H
#define UPESI_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {          // round to nearest even, as torch (NaN kept quiet)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef __AVX2__
#include <immintrin.h>

// 8 bf16 -> fp32 (exact).
static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

// 8 fp32 lanes rounded to bf16 and back, each as round_bf16 (round to nearest even, NaN kept quiet).
static inline __m256 round_bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v), hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), hi);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, hi), _mm256_set1_epi32(0x400000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, quiet, nan));
}

// 8 fp32 -> bf16, each as f32_to_bf16.
static inline __m128i f32x8_to_bf16(__m256 v) {
    __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16x8(v)), 16);
    __m256i packed = _mm256_packus_epi32(r, r);                  // per 128-bit lane: r0-3 r0-3 | r4-7 r4-7
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// A row of n bf16 -> fp32, and back (the same conversions as above, 8 at a time, the tail one by one).
static inline void bf16_row_to_f32(const uint16_t *s, int64_t n, float *d) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, bf16x8_to_f32(s + i));
    for (; i < n; i++)
        d[i] = bf16_to_f32(s[i]);
}

static inline void f32_row_to_bf16(const float *s, int64_t n, uint16_t *d) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i), f32x8_to_bf16(_mm256_loadu_ps(s + i)));
    for (; i < n; i++)
        d[i] = f32_to_bf16(s[i]);
}
#endif
#endif
