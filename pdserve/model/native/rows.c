/* Few-row float32 products on the CPU, M <= 8 rows (a decode step: one row per request):
 *   pd_heads_linear: y[m, h, n] = sum_k x[m, h, k] * w[h, n, k] (+ b[n]) for H heads of W [N, K]
 *                    (H = 1: a linear layer; H > 1: MLA's absorbed W_UV, one [v, c] matrix per head);
 *   pd_heads_axpy:   y[m, h, c] = sum_n x[m, h, n] * w[h, n, c] (MLA's absorbed W_UK: the sum runs
 *                    over W's rows, so each row is added, scaled, into the output held in L1).
 * Every W is given by its pointer and strides in floats, its rows contiguous.
 *
 * Why it exists (pdserve/model/native.py has the measurements): such a product is a read of W and
 * nothing else, and the BLAS kernels torch ships read W at 12-33 GB/s on the CPUs this was measured
 * on, where a plain sum of the same matrix reads at 25-48 GB/s. Here each thread streams a
 * contiguous block of W's rows once, in order, with every x row held in L1, so W is read at about
 * the rate of a sum.
 *
 * Built at first use by native.py (cc -O3 -mavx2 -mfma -fopenmp); OpenMP resolves to the libgomp
 * torch has loaded, so these loops share torch's threads. Only called after the caller checked that
 * the CPU has AVX2 and FMA (torch's own CPU capability) and that the pointers, strides and sizes
 * describe float32 tensors of these shapes.
 */
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
static void pack(const float *x, int64_t ldx, int64_t M, int64_t K, float *xp) {
    for (int64_t k = 0; k + 8 <= K; k += 8)
        for (int64_t m = 0; m < M; m++, xp += 8)
            for (int j = 0; j < 8; j++)
                xp[j] = x[m * ldx + k + j];
}

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
            switch (M) {
            case 1: out[0] = dot1(wn, xh, K); break;
            case 2: dot_rows(wn, xph, xh, ldx_m, 2, K, out); break;
            case 3: dot_rows(wn, xph, xh, ldx_m, 3, K, out); break;
            case 4: dot_rows(wn, xph, xh, ldx_m, 4, K, out); break;
            case 5: dot_rows(wn, xph, xh, ldx_m, 5, K, out); break;
            case 6: dot_rows(wn, xph, xh, ldx_m, 6, K, out); break;
            case 7: dot_rows(wn, xph, xh, ldx_m, 7, K, out); break;
            default: dot_rows(wn, xph, xh, ldx_m, 8, K, out); break;
            }
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

/* One token through k routed experts of a SwiGLU MoE (a decode step at batch 1):
 *   y[n] = sum_j weight[j] * sum_i down[e_j][n, i] * silu(gu[e_j][i] . x) * (gu[e_j][I + i] . x)
 * with gu [E, 2I, H] (gate rows, then up rows) and down [E, H, I], experts in the order given. Each
 * thread owns the same rows of every expert's products (static schedule), so each y[n] is one
 * thread's sum in expert order and the result does not depend on the thread count. One parallel
 * region for all k experts instead of 2k products and their element-wise ops. */
int pd_moe_token(const float *x, const float *gu, int64_t ldgu_e, int64_t ldgu_r, const float *down,
                 int64_t ldd_e, int64_t ldd_r, const int64_t *experts, const float *weights, int64_t k,
                 int64_t H, int64_t I, float *y, int threads) {
    float *act = malloc(sizeof(float) * (size_t)(k * I + 8));
    if (!act)
        return -1;
    for (int64_t n = 0; n < H; n++)
        y[n] = 0.0f;
#pragma omp parallel num_threads(threads) if (k * 3 * I * H >= GRAIN)
    for (int64_t j = 0; j < k; j++) {
        const float *g = gu + experts[j] * ldgu_e, *d = down + experts[j] * ldd_e;
        float *a = act + j * I;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < I; i++) {
            float gate = dot1(g + i * ldgu_r, x, H), up = dot1(g + (I + i) * ldgu_r, x, H);
            a[i] = gate / (1.0f + expf(-gate)) * up;
        }
        /* the implicit barrier above: every act of expert j is there */
#pragma omp for schedule(static) nowait
        for (int64_t n = 0; n < H; n++)
            y[n] += weights[j] * dot1(d + n * ldd_r, a, I);
    }
    free(act);
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

/* index of the largest v[i] over i with allowed[i], the earliest on ties; -1 when none is allowed */
static int64_t argmax_allowed(const float *v, const uint8_t *allowed, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (allowed[i] && (best < 0 || v[i] > v[best]))
            best = i;
    return best;
}

/* A MoE router for one token (DeepSeek-V3's grouped sigmoid routing): s = sigmoid(W x); the
 * n_group groups ranked by the sum of their two best s + bias, the best topk_group of them kept,
 * and in those the k experts of the largest s + bias; their weights s (normalized to sum 1 when
 * norm), times scaling. Ties go to the earlier group or expert. ids come out ascending, with their
 * weights. */
int pd_route_token(const float *x, const float *w, int64_t ldw, const float *bias, int64_t E, int64_t H,
                   int64_t n_group, int64_t topk_group, int64_t k, int norm, float scaling, int64_t *ids,
                   float *weights, int threads) {
    float *s = malloc(sizeof(float) * (size_t)(3 * E + n_group + 8));
    uint8_t *flags = malloc((size_t)(E + n_group + 8));
    if (!s || !flags) {
        free(s), free(flags);
        return -1;
    }
    float *choice = s + E, *group = choice + E;
    uint8_t *allowed = flags, *gsel = flags + E;
    int64_t per = E / n_group;
#pragma omp parallel for schedule(static) num_threads(threads) if (E * H >= GRAIN)
    for (int64_t e = 0; e < E; e++)
        s[e] = 1.0f / (1.0f + expf(-dot1(w + e * ldw, x, H)));
    for (int64_t e = 0; e < E; e++)
        choice[e] = s[e] + bias[e];
    for (int64_t g = 0; g < n_group; g++) { /* the sum of each group's two best */
        const float *c = choice + g * per;
        int64_t a = 0;
        for (int64_t i = 1; i < per; i++)
            a = c[i] > c[a] ? i : a;
        int64_t b = a == 0 ? 1 : 0;
        for (int64_t i = 0; i < per; i++)
            b = i != a && c[i] > c[b] ? i : b;
        group[g] = c[a] + c[b];
        gsel[g] = 1;
    }
    for (int64_t e = 0; e < E; e++)
        allowed[e] = 0;
    for (int64_t j = 0; j < topk_group; j++) { /* the best groups' experts become choosable */
        int64_t g = argmax_allowed(group, gsel, n_group);
        gsel[g] = 0;
        for (int64_t i = 0; i < per; i++)
            allowed[g * per + i] = 1;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t e = argmax_allowed(choice, allowed, E);
        allowed[e] = 0;
        ids[j] = e;
    }
    for (int64_t a = 1; a < k; a++) /* ascending ids (insertion sort: k is small) */
        for (int64_t b = a; b > 0 && ids[b - 1] > ids[b]; b--) {
            int64_t t = ids[b];
            ids[b] = ids[b - 1], ids[b - 1] = t;
        }
    for (int64_t j = 0; j < k; j++)
        total += s[ids[j]];
    for (int64_t j = 0; j < k; j++)
        weights[j] = (norm ? s[ids[j]] / (total + 1e-20f) : s[ids[j]]) * scaling;
    free(s), free(flags);
    return 0;
}
