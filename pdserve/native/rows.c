/* Few-row float32 products on the CPU, M <= 8 rows (a decode step: one row per request):
 *   pd_heads_linear: y[m, h, n] = sum_k x[m, h, k] * w[h, n, k] (+ b[n]) for H heads of W [N, K]
 *                    (H = 1: a linear layer; H > 1: MLA's absorbed W_UV, one [v, c] matrix per head);
 *   pd_heads_axpy:   y[m, h, c] = sum_n x[m, h, n] * w[h, n, c] (MLA's absorbed W_UK: the sum runs
 *                    over W's rows, so each row is added, scaled, into the output held in L1).
 * Every W is given by its pointer and strides in floats, its rows contiguous.
 *
 * Why it exists (pdserve/native/ops.py has the measurements): such a product is a read of W and
 * nothing else, and the BLAS kernels torch ships read W at 12-33 GB/s on the CPUs this was measured
 * on, where a plain sum of the same matrix reads at 25-48 GB/s. Here each thread streams a
 * contiguous block of W's rows once, in order, with every x row held in L1, so W is read at about
 * the rate of a sum.
 *
 * The dot products themselves are in rows.h (shared with moe.c). Built at first use by native.py (cc -O3 -mavx2 -mfma -fopenmp); OpenMP resolves to the libgomp
 * torch has loaded, so these loops share torch's threads. Only called after the caller checked that
 * the CPU has AVX2 and FMA (torch's own CPU capability) and that the pointers, strides and sizes
 * describe float32 tensors of these shapes.
 */
#include "rows.h"

int pd_heads_linear(const float *x, int64_t ldx_m, int64_t ldx_h, const float *w, int64_t ldw_n,
                    int64_t ldw_h, const float *b, float *y, int64_t ldy_m, int64_t ldy_h, int64_t M,
                    int64_t H, int64_t N, int64_t K, int threads) {
    int64_t blocks = (N + BLOCK - 1) / BLOCK, packed = (K / 8) * 8 * M;
    float *xp = NULL;
    if (M > 1) { /* every head's rows packed once, before the threads start */
        xp = malloc(sizeof(float) * (size_t)(H * packed + 8));
        if (!xp)
            return -1;
        for (int64_t h = 0; h < H; h++)
            pack(x + h * ldx_h, ldx_m, M, K, xp + h * packed);
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (H * N * K >= GRAIN)
    for (int64_t unit = 0; unit < H * blocks; unit++) {
        int64_t h = unit / blocks, blk = unit % blocks;
        int64_t end = (blk + 1) * BLOCK < N ? (blk + 1) * BLOCK : N;
        const float *xh = x + h * ldx_h, *xph = xp ? xp + h * packed : NULL;
        float out[MAX_ROWS];
        for (int64_t n = blk * BLOCK; n < end; n++) {
            const float *wn = w + h * ldw_h + n * ldw_n;
            rows_dot(wn, xph, xh, ldx_m, M, K, out);
            float bias = b ? b[n] : 0.0f;
            for (int64_t m = 0; m < M; m++)
                y[m * ldy_m + h * ldy_h + n] = out[m] + bias;
        }
    }
    free(xp);
    return 0;
}

#define COLS 512 /* output columns per scheduling unit of pd_heads_axpy (MLA: all of c = 512, so a unit reads
                  * one head's W as one stream), M x 2 KB of sums in L1 */

int pd_heads_axpy(const float *x, int64_t ldx_m, int64_t ldx_h, const float *w, int64_t ldw_n,
                  int64_t ldw_h, float *y, int64_t ldy_m, int64_t ldy_h, int64_t M, int64_t H,
                  int64_t N, int64_t C, int threads) {
    int64_t chunks = (C + COLS - 1) / COLS;
#pragma omp parallel for schedule(static) num_threads(threads) if (H * N * C >= GRAIN)
    for (int64_t unit = 0; unit < H * chunks; unit++) {
        int64_t h = unit / chunks, c0 = (unit % chunks) * COLS;
        int64_t width = C - c0 < COLS ? C - c0 : COLS, vec = (width / 8) * 8;
        float acc[MAX_ROWS][COLS];
        for (int64_t m = 0; m < M; m++)
            for (int64_t c = 0; c < width; c++)
                acc[m][c] = 0.0f;
        for (int64_t n = 0; n < N; n++) { /* rows of W in order: one stream */
            const float *wn = w + h * ldw_h + n * ldw_n + c0;
            for (int64_t m = 0; m < M; m++) {
                float s = x[m * ldx_m + h * ldx_h + n];
                __m256 sv = _mm256_set1_ps(s);
                int64_t c = 0;
                for (; c < vec; c += 8)
                    _mm256_storeu_ps(acc[m] + c, _mm256_fmadd_ps(sv, _mm256_loadu_ps(wn + c),
                                                                  _mm256_loadu_ps(acc[m] + c)));
                for (; c < width; c++)
                    acc[m][c] += s * wn[c];
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int64_t c = 0; c < width; c++)
                y[m * ldy_m + h * ldy_h + c0 + c] = acc[m][c];
    }
    return 0;
}

/* RMSNorm of M rows of N floats: y[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, on the calling thread
 * (a decode step's few rows: a call instead of torch's seven ops, each slow on caches a weight
 * stream has just flushed). */
int pd_rms_norm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N,
                float eps, int threads) {
    (void)threads;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        float inv = 1.0f / sqrtf(dot1(xm, xm, N) / (float)N + eps);
        __m256 iv = _mm256_set1_ps(inv);
        int64_t n = 0;
        for (; n + 8 <= N; n += 8)
            _mm256_storeu_ps(ym + n, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xm + n), iv), _mm256_loadu_ps(w + n)));
        for (; n < N; n++)
            ym[n] = xm[n] * inv * w[n];
    }
    return 0;
}
