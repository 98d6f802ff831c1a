/* The few-row dot products that rows.c's and moe.c's kernels share (static inline: each kernel's
 * loops keep their sums in registers). See rows.c for why they exist. */
#ifndef PD_ROWS_H
#define PD_ROWS_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_ROWS 8
/* W of fewer floats is read by the calling thread alone: waking the team would cost more than the
 * read, and its threads would then spin, taking the cores from the other ranks of a small machine */
#define GRAIN (64 * 1024)
#define BLOCK 16 /* rows of W per scheduling unit: threads take contiguous runs of blocks */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* one row: four independent sums, so the FMA latency never waits on memory */
static inline float dot1(const float *w, const float *x, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; k++)
        s += w[k] * x[k];
    return s;
}

/* M rows: one sum per row, each W load shared by all of them. x comes packed (`pack`): for each
 * 8 columns, the M rows' 8 values side by side, so the rows' loads never alias each other in L1 (rows
 * of x a power of two apart would). Inlined with a constant M (the switch below), so the loops over
 * m unroll and the sums stay in registers. */
static inline __attribute__((always_inline)) void dot_rows(const float *w, const float *xp, const float *x,
                                                           int64_t ldx, int64_t M, int64_t K, float *out) {
    __m256 acc[MAX_ROWS];
    for (int64_t m = 0; m < M; m++)
        acc[m] = _mm256_setzero_ps();
    __m256 acc2[MAX_ROWS / 2]; /* a second sum per row when M <= 4: at least 4 chains in flight */
    for (int64_t m = 0; m < M && M <= MAX_ROWS / 2; m++)
        acc2[m] = _mm256_setzero_ps();
    int64_t k = 0;
    if (M <= MAX_ROWS / 2) {
        for (; k + 16 <= K; k += 16, xp += 16 * M) {
            __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
            for (int64_t m = 0; m < M; m++) {
                acc[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp + 8 * m), acc[m]);
                acc2[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + 8 * (M + m)), acc2[m]);
            }
        }
        for (int64_t m = 0; m < M; m++)
            acc[m] = _mm256_add_ps(acc[m], acc2[m]);
    }
    for (; k + 8 <= K; k += 8, xp += 8 * M) {
        __m256 wk = _mm256_loadu_ps(w + k);
        for (int64_t m = 0; m < M; m++)
            acc[m] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(xp + 8 * m), acc[m]);
    }
    for (int64_t m = 0; m < M; m++) {
        float s = hsum(acc[m]);
        for (int64_t j = k; j < K; j++)
            s += w[j] * x[m * ldx + j];
        out[m] = s;
    }
}

/* x[m, k] (row stride ldx) -> [K / 8][M][8] */
static inline void pack(const float *x, int64_t ldx, int64_t M, int64_t K, float *xp) {
    for (int64_t k = 0; k + 8 <= K; k += 8)
        for (int64_t m = 0; m < M; m++, xp += 8)
            for (int j = 0; j < 8; j++)
                xp[j] = x[m * ldx + k + j];
}

/* out[m] = W row . x row m for M <= MAX_ROWS rows (x packed by `pack` when M > 1), M a constant in
 * each case so `dot_rows` unrolls */
static inline void rows_dot(const float *w, const float *xp, const float *x, int64_t ldx, int64_t M,
                            int64_t K, float *out) {
    switch (M) {
    case 1: out[0] = dot1(w, x, K); break;
    case 2: dot_rows(w, xp, x, ldx, 2, K, out); break;
    case 3: dot_rows(w, xp, x, ldx, 3, K, out); break;
    case 4: dot_rows(w, xp, x, ldx, 4, K, out); break;
    case 5: dot_rows(w, xp, x, ldx, 5, K, out); break;
    case 6: dot_rows(w, xp, x, ldx, 6, K, out); break;
    case 7: dot_rows(w, xp, x, ldx, 7, K, out); break;
    default: dot_rows(w, xp, x, ldx, 8, K, out); break;
    }
}
#endif
