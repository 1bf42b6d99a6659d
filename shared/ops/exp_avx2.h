// e^x for 8 fp32 lanes with AVX2 and FMA, shared by the C kernels of shared/ops (cpu_attention.c, decoder_f32.c):
// Cephes' polynomial after x = n ln2 + r, about 1 ulp.
#ifndef UPESI_EXP_AVX2_H
#define UPESI_EXP_AVX2_H
#include <immintrin.h>

// x (already clamped) -> the polynomial p ~ e^r, with n = round(x / ln2) in *n.
static inline __m256 exp8_poly(__m256 x, __m256 *n) {
    *n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(*n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(*n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    return _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
}

// 2^(n + bias - 127) for integral n, as fp32 bits.
static inline __m256 exp8_pow2(__m256 n, int bias) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(bias)),
                                                 23));
}

// e^x for x <= 0 (scores minus their maximum); under -87.3 it clamps.
static inline __m256 exp8(__m256 x) {
    __m256 n, p = exp8_poly(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), &n);
    return _mm256_mul_ps(p, exp8_pow2(n, 127));
}

// e^x for any x: scaled by 2^(n - 1) then 2 (so n = 128 stays finite); above 88.7228 inf, below -86 the value at
// -86 (where 1 + e^x is 1).
static inline __m256 exp8_any(__m256 x) {
    __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.7228f), _CMP_GT_OQ);
    __m256 n, p = exp8_poly(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-86.0f)), _mm256_set1_ps(88.7228f)), &n);
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(p, exp8_pow2(n, 126)), _mm256_set1_ps(2.f));
    return _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_inff()), big);
}
#endif
