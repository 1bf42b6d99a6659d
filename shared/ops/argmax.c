// Each row's first index of its maximum, for fp32 rows on CPU (shared/ops/argmax.py loads this with ctypes).
//
// out [M] int64 = the index torch.argmax gives: the first position holding the row's maximum, or the first NaN
// when the row has one. Two passes over a row (it stays in L2 between them): an 8-lane max that also notes any
// NaN, then a scan for the first lane equal to it (-0 and +0 compare equal, as in torch). Rows are split between
// the threads. Shapes: M = rows, V = columns (the vocabulary).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static int64_t row_argmax(const float *x, int64_t v) {
    __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= v; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i);
        mx = _mm256_max_ps(mx, a);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, mx);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = i; j < v; j++) {
        if (x[j] != x[j]) any_nan = 1;
        else if (x[j] > m) m = x[j];
    }
    if (any_nan) {
        for (int64_t j = 0; j < v; j++)
            if (x[j] != x[j]) return j;
    }
    __m256 mv = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= v; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < v; i++)
        if (x[i] == m) return i;
    return 0;                                               // a row of -inf only: its first index, as torch
}

// x [M, V] fp32 (rows ldx apart) -> out [M] int64.
void upesi_argmax_rows(const float *x, int64_t m, int64_t ldx, int64_t v, int64_t *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m > 1)
    for (int64_t r = 0; r < m; r++) out[r] = row_argmax(x + r * ldx, v);
}
