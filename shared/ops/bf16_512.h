// AVX-512 bf16 <-> fp32 for 16 lanes, bit for bit bf16.h's conversions (round to nearest even, NaN kept quiet).
// Each function carries its own target attribute, so files built for AVX2 can hold AVX-512 paths that run only
// where upesi_avx512() says the CPU has them.
#ifndef UPESI_BF16_512_H
#define UPESI_BF16_512_H
#include <immintrin.h>
#include <stdint.h>

#define UPESI_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

static inline int upesi_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

// A kernel's choice of its AVX-512 path: *state is -1 until decided, then 1 (AVX-512) or 0 (AVX2).
static inline int avx512_choose(int *state, int on) {
    *state = on && upesi_avx512();
    return *state;
}

static inline int avx512_chosen(int *state) {
    if (*state < 0) *state = upesi_avx512();
    return *state;
}

static inline __mmask16 mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

// 16 bf16 (the lanes of m; the others read as 0) -> fp32, exact.
UPESI_AVX512 static inline __m512 bf16x16_load(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// 16 fp32 -> their bf16 bits in the low half of each 32-bit lane.
UPESI_AVX512 static inline __m512i bf16x16_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

// 16 fp32 rounded to bf16 and back.
UPESI_AVX512 static inline __m512 bf16x16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_bits(v), 16));
}

UPESI_AVX512 static inline void bf16x16_store(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16x16_bits(v)));
}

// A row's 16 values from bf16 or fp32 storage, and back (bf16: rounded).
UPESI_AVX512 static inline __m512 row16_load(const void *base, int64_t i, __mmask16 m, int bf16) {
    return bf16 ? bf16x16_load((const uint16_t *)base + i, m) : _mm512_maskz_loadu_ps(m, (const float *)base + i);
}

UPESI_AVX512 static inline void row16_store(void *base, int64_t i, __m512 v, __mmask16 m, int bf16) {
    if (bf16)
        bf16x16_store((uint16_t *)base + i, v, m);
    else
        _mm512_mask_storeu_ps((float *)base + i, m, v);
}
#endif
