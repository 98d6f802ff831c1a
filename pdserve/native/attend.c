/* Softmax attention of a few queries over their keys, float32 on the CPU (a decode step's MLA):
 *   pd_attend: out[b, h, :dv] = sum_s softmax_s(scale * q[b, h] . k[b, s]) * k[b, s, :dv] over the
 *              keys s with valid[b, s]; lse[b, h] = log sum_s exp(scale * q[b, h] . k[b, s]) (natural
 *              log), -inf with out 0 where a query has no valid key. Values are the keys' first dv
 *              columns (MLA's latent). Keys per query (ldk_b > 0) or shared by all (ldk_b = 0), or
 *              rows of a table named per query (a sparse layer's selection: the KV cache itself).
 *
 * Why it exists: torch computes this as a batched matmul, a masked fill, a logsumexp, an exp and a
 * second batched matmul, each a pass over [H, S] or the keys; for one query of 16 heads over 512
 * keys of 576 floats that is about 450 us on two threads, most of it in calls and passes, not sums.
 * Here each thread takes whole units of keys (a fixed number of them: the result does not depend on
 * the thread count), computes their scores and a running softmax (flash-attention's rescaling), adds
 * the weighted values into sums kept per unit, and the units are merged by their log-sum-exp.
 *
 * Built with rows.c into one library (native.py); the caller checked the shapes and strides.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define CHUNK 32        /* keys scored, then added, together: their rows stay in L2 between the passes */
#define MIN_UNIT 256    /* keys per unit at least */
#define MAX_UNITS 16
#define MAX_HEADS 1024

/* exp(x) for x <= 0 (and -inf): Cephes' polynomial after 2^n range reduction; below -87 gives 0 */
static inline __m256 exp_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* G query heads (G <= 8, a constant where inlined) against one key: each key load serves every head */
static inline __attribute__((always_inline)) void dots(const float *const *q, const float *k, int64_t D, int G,
                                                       float *out) {
    __m256 acc[8];
    for (int g = 0; g < G; g++)
        acc[g] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 kv = _mm256_loadu_ps(k + d);
        for (int g = 0; g < G; g++)
            acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), kv, acc[g]);
    }
    for (int g = 0; g < G; g++) {
        float s = hsum8(acc[g]);
        for (int64_t j = d; j < D; j++)
            s += q[g][j] * k[j];
        out[g] = s;
    }
}

/* acc[c] += sum_s p[s] * v_s[c] for two heads' sums (a, b) over n keys, 32 columns at a time in registers */
static void add_values(const float *const *v, int64_t n, const float *pa, const float *pb, float *acc_a,
                       float *acc_b, int64_t DV) {
    int64_t c = 0;
    for (; c + 32 <= DV; c += 32) {
        __m256 a0 = _mm256_loadu_ps(acc_a + c), a1 = _mm256_loadu_ps(acc_a + c + 8);
        __m256 a2 = _mm256_loadu_ps(acc_a + c + 16), a3 = _mm256_loadu_ps(acc_a + c + 24);
        __m256 b0 = _mm256_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
        if (acc_b) {
            b0 = _mm256_loadu_ps(acc_b + c), b1 = _mm256_loadu_ps(acc_b + c + 8);
            b2 = _mm256_loadu_ps(acc_b + c + 16), b3 = _mm256_loadu_ps(acc_b + c + 24);
        }
        for (int64_t s = 0; s < n; s++) {
            const float *vs = v[s] + c;
            __m256 v0 = _mm256_loadu_ps(vs), v1 = _mm256_loadu_ps(vs + 8);
            __m256 v2 = _mm256_loadu_ps(vs + 16), v3 = _mm256_loadu_ps(vs + 24);
            __m256 w = _mm256_set1_ps(pa[s]);
            a0 = _mm256_fmadd_ps(w, v0, a0), a1 = _mm256_fmadd_ps(w, v1, a1);
            a2 = _mm256_fmadd_ps(w, v2, a2), a3 = _mm256_fmadd_ps(w, v3, a3);
            if (acc_b) {
                w = _mm256_set1_ps(pb[s]);
                b0 = _mm256_fmadd_ps(w, v0, b0), b1 = _mm256_fmadd_ps(w, v1, b1);
                b2 = _mm256_fmadd_ps(w, v2, b2), b3 = _mm256_fmadd_ps(w, v3, b3);
            }
        }
        _mm256_storeu_ps(acc_a + c, a0), _mm256_storeu_ps(acc_a + c + 8, a1);
        _mm256_storeu_ps(acc_a + c + 16, a2), _mm256_storeu_ps(acc_a + c + 24, a3);
        if (acc_b) {
            _mm256_storeu_ps(acc_b + c, b0), _mm256_storeu_ps(acc_b + c + 8, b1);
            _mm256_storeu_ps(acc_b + c + 16, b2), _mm256_storeu_ps(acc_b + c + 24, b3);
        }
    }
    for (; c < DV; c++) {
        float sa = acc_a[c], sb = acc_b ? acc_b[c] : 0.0f;
        for (int64_t s = 0; s < n; s++) {
            sa += pa[s] * v[s][c];
            sb += pb ? pb[s] * v[s][c] : 0.0f;
        }
        acc_a[c] = sa;
        if (acc_b)
            acc_b[c] = sb;
    }
}

/* One unit: keys [s0, s1) of query b. m, l, acc: this unit's running max, sum and weighted values
 * per head (acc [H][DV]); sc: CHUNK * H floats of the thread's own. */
static void unit(const float *q, int64_t ldq_b, int64_t ldq_h, const float *keys, int64_t ldk_b,
                 int64_t ldk_s, const int64_t *idx, const uint8_t *valid, int64_t ldv_b, int64_t ldv_s,
                 int64_t b, int64_t s0, int64_t s1, int64_t H, int64_t D, int64_t DV, float scale, float *m,
                 float *l, float *acc, float *sc) {
    const float *qh[MAX_HEADS];
    for (int64_t h = 0; h < H; h++) {
        qh[h] = q + b * ldq_b + h * ldq_h;
        m[h] = -INFINITY, l[h] = 0.0f;
        for (int64_t c = 0; c < DV; c++)
            acc[h * DV + c] = 0.0f;
    }
    const float *rows[CHUNK];
    for (int64_t c0 = s0; c0 < s1; c0 += CHUNK) {
        int64_t n = 0; /* the chunk's valid keys, packed */
        for (int64_t s = c0; s < s1 && s < c0 + CHUNK; s++)
            if (valid[b * ldv_b + s * ldv_s]) /* key s: its own row, or the table row idx names */
                rows[n++] = idx ? keys + idx[b * ldk_b + s] * ldk_s : keys + b * ldk_b + s * ldk_s;
        if (n == 0)
            continue;
        int64_t padded = (n + 7) & ~(int64_t)7;
        float part[8];
        for (int64_t h = 0; h < H; h += 8) /* sc[h * CHUNK + s]: scaled scores; 8 heads' q in L1 */
            for (int64_t s = 0; s < n; s++) {
                int G = H - h < 8 ? (int)(H - h) : 8;
                switch (G) {
                case 8: dots(qh + h, rows[s], D, 8, part); break;
                case 4: dots(qh + h, rows[s], D, 4, part); break;
                case 2: dots(qh + h, rows[s], D, 2, part); break;
                case 1: dots(qh + h, rows[s], D, 1, part); break;
                default: dots(qh + h, rows[s], D, G, part); break;
                }
                for (int g = 0; g < G; g++)
                    sc[(h + g) * CHUNK + s] = part[g] * scale;
            }
        for (int64_t h = 0; h < H; h++) {
            float *p = sc + h * CHUNK, mx = m[h];
            for (int64_t s = 0; s < n; s++)
                mx = p[s] > mx ? p[s] : mx;
            for (int64_t s = n; s < padded; s++)
                p[s] = -INFINITY;
            if (mx > m[h] && m[h] > -INFINITY) { /* rescale what was summed under the smaller max */
                float alpha = expf(m[h] - mx);
                l[h] *= alpha;
                for (int64_t c = 0; c < DV; c++)
                    acc[h * DV + c] *= alpha;
            }
            m[h] = mx;
            __m256 mv = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
            for (int64_t s = 0; s < padded; s += 8) {
                __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(p + s), mv));
                _mm256_storeu_ps(p + s, e);
                sum = _mm256_add_ps(sum, e);
            }
            l[h] += hsum8(sum);
        }
        for (int64_t h = 0; h < H; h += 2) {
            int two = h + 1 < H;
            add_values(rows, n, sc + h * CHUNK, two ? sc + (h + 1) * CHUNK : NULL, acc + h * DV,
                       two ? acc + (h + 1) * DV : NULL, DV);
        }
    }
}

/* idx (may be NULL): keys is then a table of rows (row stride ldk_s, `rows` of them) and key s of
 * query b is its row idx[b * ldk_b + s] (read only where valid): the gather happens as the rows are
 * read, with no gathered copy. Returns -3 (nothing computed) when a valid key's row is outside the table. */
int pd_attend(const float *q, int64_t ldq_b, int64_t ldq_h, const float *keys, int64_t ldk_b, int64_t ldk_s,
              const int64_t *idx, int64_t rows, const uint8_t *valid, int64_t ldv_b, int64_t ldv_s, float *out,
              float *lse, int64_t B, int64_t H, int64_t S, int64_t D, int64_t DV, float scale, int threads) {
    if (H > MAX_HEADS)
        return -2;
    for (int64_t b = 0; idx && b < B; b++)
        for (int64_t s = 0; s < S; s++)
            if (valid[b * ldv_b + s * ldv_s] && (idx[b * ldk_b + s] < 0 || idx[b * ldk_b + s] >= rows))
                return -3;
    /* MAX_UNITS / B units per query, one from B >= MAX_UNITS on: the partial sums take at most
     * max(B, MAX_UNITS) x H x (DV + 2) floats; like the unit size, a function of B and S only */
    int64_t most = MAX_UNITS / B > 1 ? MAX_UNITS / B : 1;
    int64_t per = (S + most - 1) / most;
    per = per > MIN_UNIT ? per : MIN_UNIT;
    per = (per + CHUNK - 1) / CHUNK * CHUNK;
    int64_t units = S > 0 ? (S + per - 1) / per : 1, stride = H * (DV + 2);
    float *parts = malloc(sizeof(float) * (size_t)(B * units * stride));
    float *sc = malloc(sizeof(float) * (size_t)(threads * CHUNK * H));
    if (!parts || !sc) {
        free(parts), free(sc);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (B * S * H * D >= 64 * 1024)
    for (int64_t i = 0; i < B * units; i++) {
        int64_t b = i / units, s0 = (i % units) * per, s1 = s0 + per < S ? s0 + per : S;
        float *part = parts + i * stride;
        unit(q, ldq_b, ldq_h, keys, ldk_b, ldk_s, idx, valid, ldv_b, ldv_s, b, s0, s1, H, D, DV, scale, part,
             part + H, part + 2 * H, sc + omp_get_thread_num() * CHUNK * H);
    }
    /* merge the units of each query by their log-sum-exp, in unit order */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            float mx = -INFINITY, total = 0.0f, w[MAX_UNITS];
            for (int64_t u = 0; u < units; u++) {
                float mu = parts[(b * units + u) * stride + h];
                mx = mu > mx ? mu : mx;
            }
            float *o = out + (b * H + h) * DV;
            for (int64_t c = 0; c < DV; c++)
                o[c] = 0.0f;
            if (mx == -INFINITY) {
                lse[b * H + h] = -INFINITY;
                continue;
            }
            for (int64_t u = 0; u < units; u++) {
                const float *part = parts + (b * units + u) * stride;
                w[u] = part[h] == -INFINITY ? 0.0f : expf(part[h] - mx);
                total += w[u] * part[H + h];
            }
            for (int64_t u = 0; u < units; u++) {
                if (w[u] == 0.0f)
                    continue;
                const float *a = parts + (b * units + u) * stride + 2 * H + h * DV;
                float f = w[u] / total;
                for (int64_t c = 0; c < DV; c++)
                    o[c] += f * a[c];
            }
            lse[b * H + h] = mx + logf(total);
        }
    free(parts), free(sc);
    return 0;
}

/* DSA indexer scores of a few queries: out[b, s] = sum_h w[b, h] * relu(scale * q[b, h] . k[b, s]),
 * keys per query (ldk_b > 0) or shared (ldk_b = 0); one pass over the keys, no [B, H, S] temporary. */
int pd_index_scores(const float *q, int64_t ldq_b, int64_t ldq_h, const float *w, int64_t ldw_b,
                    const float *keys, int64_t ldk_b, int64_t ldk_s, float *out, int64_t B, int64_t H,
                    int64_t S, int64_t D, float scale, int threads) {
    if (H > MAX_HEADS)
        return -2;
#pragma omp parallel for schedule(static) num_threads(threads) if (B * S * H * D >= 256 * 1024)
    for (int64_t i = 0; i < B * S; i++) {
        int64_t b = i / S, s = i % S;
        const float *qh[8], *k = keys + b * ldk_b + s * ldk_s;
        float part[8], total = 0.0f;
        for (int64_t h = 0; h < H; h += 8) {
            int G = H - h < 8 ? (int)(H - h) : 8;
            for (int g = 0; g < G; g++)
                qh[g] = q + b * ldq_b + (h + g) * ldq_h;
            if (G == 8)
                dots(qh, k, D, 8, part);
            else
                dots(qh, k, D, G, part);
            for (int g = 0; g < G; g++) {
                float v = part[g] * scale;
                total += w[b * ldw_b + h + g] * (v > 0.0f ? v : 0.0f);
            }
        }
        out[i] = total;
    }
    return 0;
}

/* k-th largest (0-based) of a[0..n) by quickselect; reorders a */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        float x = a[lo], y = a[(lo + hi) / 2], z = a[hi]; /* median of three */
        float pivot = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) { /* descending: big values to the left */
            while (a[i] > pivot)
                i++;
            while (a[j] < pivot)
                j--;
            if (i <= j) {
                float t = a[i];
                a[i] = a[j], a[j] = t;
                i++, j--;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return a[k];
    }
    return a[k];
}

/* Top-k per row with the earlier key winning ties (docs/design.md invariant 3): out[b] holds the
 * chosen indices ascending, -1 padded where a row has fewer than k valid keys. Returns 1 (nothing
 * decided) when a valid score is NaN: the caller keeps torch's rule for those. */
int pd_topk_earliest(const float *scores, int64_t lds, const uint8_t *valid, int64_t ldv_b, int64_t ldv_s,
                     int64_t B, int64_t S, int64_t k, int64_t *out, int threads) {
    int nan = 0, oom = 0;
#pragma omp parallel num_threads(threads) if (B * S >= 64 * 1024)
    {
        float *buf = malloc(sizeof(float) * (size_t)(S + 1));
        if (!buf) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            if (!buf)
                continue;
            const float *sc = scores + b * lds;
            const uint8_t *vb = valid + b * ldv_b;
            int64_t n = 0, *o = out + b * k, got = 0;
            for (int64_t s = 0; s < S; s++)
                if (vb[s * ldv_s]) {
                    if (sc[s] != sc[s]) {
#pragma omp atomic write
                        nan = 1;
                    }
                    buf[n++] = sc[s];
                }
            if (n <= k) { /* every valid key */
                for (int64_t s = 0; s < S; s++)
                    if (vb[s * ldv_s])
                        o[got++] = s;
            } else {
                float kth = kth_largest(buf, n, k - 1);
                int64_t above = 0;
                for (int64_t s = 0; s < S; s++)
                    above += vb[s * ldv_s] && sc[s] > kth;
                int64_t tied = k - above; /* the earliest of the keys equal to the k-th score */
                for (int64_t s = 0; s < S; s++)
                    if (vb[s * ldv_s] && (sc[s] > kth || (sc[s] == kth && tied-- > 0)))
                        o[got++] = s;
            }
            for (; got < k; got++)
                o[got] = -1;
        }
        free(buf);
    }
    return oom ? -1 : nan;
}
