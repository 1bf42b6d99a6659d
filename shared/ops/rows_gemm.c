/* fp32 linear layers for the few rows of a decode or verification step on x86-64 CPUs with AVX2 + FMA.
 *
 * y[M, N] = x[M, K] @ W[N, K]^T, with W prepacked into panels of 16 output columns: wp[N16 / 16][K][16]
 * (N16 = N rounded up to 16, padding columns zero). Each panel is read from memory once per call and kept in
 * cache while every tile of up to 6 rows of x runs over it (12 accumulators of 8 floats). Every output is summed
 * over k in the same order (FMA within chunks of 128, then chunk by chunk), so a row's result does not depend on M
 * or on how rows are tiled: a verification step computes each row exactly as a one-row decode does.
 * From 3 rows on, a panel's first tile also prefetches the next panel, one cache line (a k row of 16 floats) per
 * k, so that memory streams the next weights while the core computes on this panel's rows (one or two rows stream
 * at memory speed without it).
 * Panels are split across `threads` OpenMP threads (the runtime torch loaded: libgomp.so.1).
 * Built at first use by shared/ops/rows_gemm.py; its torch reference is F.linear (tests/unit/test_rows_gemm.py).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 16
#define MR 6
#define KC 128

/* One tile: mr rows of x against one panel. k runs in chunks of KC: each chunk sums into fresh accumulators that
 * are then added to y (stored on the first chunk), which keeps fp32 rounding near a blocked GEMM's over long K.
 * pf: the next panel to prefetch (or NULL). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, int64_t K, const float *wp,
                                                       float *y, int64_t ldy, int mr, const float *pf) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = K - k0 < KC ? K : k0 + KC;
        __m256 a0[MR], a1[MR];
        for (int m = 0; m < MR; m++) { a0[m] = _mm256_setzero_ps(); a1[m] = _mm256_setzero_ps(); }
        for (int64_t k = k0; k < k1; k++) {
            if (pf) _mm_prefetch((const char *)(pf + k * NR), _MM_HINT_T0);
            const __m256 w0 = _mm256_loadu_ps(wp + k * NR), w1 = _mm256_loadu_ps(wp + k * NR + 8);
            for (int m = 0; m < mr; m++) {         /* mr is a constant at every call site: unrolled */
                const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
                a0[m] = _mm256_fmadd_ps(xv, w0, a0[m]);
                a1[m] = _mm256_fmadd_ps(xv, w1, a1[m]);
            }
        }
        for (int m = 0; m < mr; m++) {
            float *o = y + m * ldy;
            if (k0) {
                a0[m] = _mm256_add_ps(_mm256_loadu_ps(o), a0[m]);
                a1[m] = _mm256_add_ps(_mm256_loadu_ps(o + 8), a1[m]);
            }
            _mm256_storeu_ps(o, a0[m]);
            _mm256_storeu_ps(o + 8, a1[m]);
        }
    }
}

#define TILE(r) tile(x + m * K, K, K, wp, out, ldo, r, m == 0 ? pf : 0)

/* One panel: all of x's rows against 16 output columns (fewer in the last panel of an N that is not a multiple
 * of 16: those rows go through a small buffer). pf: the panel to prefetch during the first tile, or NULL. */
static void panel(const float *x, int64_t M, int64_t K, const float *wp, float *y, int64_t N, int ncols,
                  const float *pf) {
    float buf[MR * NR];
    for (int64_t m = 0; m < M; m += MR) {
        const int64_t rows = M - m < MR ? M - m : MR;
        float *out = ncols == NR ? y + m * N : buf;
        const int64_t ldo = ncols == NR ? N : NR;
        switch (rows) {
            case 6: TILE(6); break;
            case 5: TILE(5); break;
            case 4: TILE(4); break;
            case 3: TILE(3); break;
            case 2: TILE(2); break;
            default: TILE(1); break;
        }
        if (ncols != NR)
            for (int64_t r = 0; r < rows; r++) memcpy(y + (m + r) * N, buf + r * NR, sizeof(float) * ncols);
    }
}

/* x [M, K] row-major, wp [ceil(N / 16)][K][16], y [M, N] row-major. */
void upesi_rows_gemm(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, float *y, int threads) {
    const int64_t panels = (N + NR - 1) / NR;
#define NEXT(p) (M >= 3 && (p) + 1 < panels ? wp + ((p) + 1) * K * NR : 0)
    if (threads <= 1 || panels < 2) {
        for (int64_t p = 0; p < panels; p++) {
            const int ncols = (int)(N - p * NR < NR ? N - p * NR : NR);
            panel(x, M, K, wp + p * K * NR, y + p * NR, N, ncols, NEXT(p));
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const int ncols = (int)(N - p * NR < NR ? N - p * NR : NR);
        panel(x, M, K, wp + p * K * NR, y + p * NR, N, ncols, NEXT(p));
    }
}
