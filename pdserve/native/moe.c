/* Routed experts of a SwiGLU MoE for a decode step's few rows, and their router, float32 on the CPU:
 *   pd_moe_rows:   y[m] = sum over the k experts e chosen for row m, ascending e, of
 *                  weight[m, e] * down[e] (silu(gu[e][:I] x[m]) * (gu[e][I:] x[m])),
 *                  gu [E, 2I, H] (gate rows, then up rows) and down [E, H, I] stacked;
 *   pd_route_rows: DeepSeek-V3's grouped sigmoid routing of each row (ids ascending, their weights).
 *
 * Why: at a batch of a few requests the rows choose a handful of experts each, and torch's grouped
 * path costs a gather, two products, their element-wise ops and an index_add per chosen expert
 * (about 1 ms of calls per layer at batch 4 on this VM, more than reading the experts' weights).
 * Here each chosen expert's weights are read once for every row that chose it (rows.h's few-row
 * dots), in one parallel region for all of them. Each thread owns the same output columns of every
 * expert's product (static schedule), so each y[m, n] is one thread's sum in ascending expert order:
 * the order of torch's grouped path, and a result that does not depend on the thread count.
 *
 * Built with rows.c into one library (native.py); the caller checked the shapes and strides.
 */
#include "rows.h"

#include <string.h>

typedef struct {
    int64_t e, n;              /* the expert and how many rows chose it (<= MAX_ROWS) */
    int64_t rows[MAX_ROWS];    /* which rows, ascending */
    float w[MAX_ROWS];         /* their weights for it */
    float *xp, *xs, *act, *ap; /* the rows packed and gathered; their activations, unpacked and packed */
} group_t;

/* (expert, row, slot) of every choice, sorted by expert, then row, then slot: insertion sort, as
 * M * k is a few dozen */
static void sort_choices(int64_t *c, int64_t n) {
    for (int64_t a = 1; a < n; a++)
        for (int64_t b = a; b > 0 && (c[3 * (b - 1)] > c[3 * b] ||
                                      (c[3 * (b - 1)] == c[3 * b] && c[3 * (b - 1) + 1] > c[3 * b + 1]));
             b--)
            for (int j = 0; j < 3; j++) {
                int64_t t = c[3 * b + j];
                c[3 * b + j] = c[3 * (b - 1) + j], c[3 * (b - 1) + j] = t;
            }
}

int pd_moe_rows(const float *x, int64_t ldx, const float *gu, int64_t ldgu_e, int64_t ldgu_r, const float *down,
                int64_t ldd_e, int64_t ldd_r, const int64_t *ids, const float *weights, int64_t M, int64_t k,
                int64_t E, int64_t H, int64_t I, float *y, int64_t ldy, int threads) {
    int64_t nc = M * k, ng = 0;
    for (int64_t j = 0; j < nc; j++)
        if (ids[j] < 0 || ids[j] >= E)
            return -3;
    int64_t *c = malloc(sizeof(int64_t) * (size_t)(3 * nc + 3));
    group_t *g = malloc(sizeof(group_t) * (size_t)(nc + 1));
    int64_t per = H + (H / 8) * 8 + I + (I / 8) * 8; /* floats of one row's xs, xp, act, ap */
    float *scratch = malloc(sizeof(float) * (size_t)(nc * per + 8));
    if (!c || !g || !scratch) {
        free(c), free(g), free(scratch);
        return -1;
    }
    for (int64_t j = 0; j < nc; j++)
        c[3 * j] = ids[j], c[3 * j + 1] = j / k, c[3 * j + 2] = j % k;
    sort_choices(c, nc);
    float *at = scratch;
    for (int64_t j = 0; j < nc; j++) { /* groups of one expert's rows, MAX_ROWS at most (a row may repeat one) */
        if (!ng || g[ng - 1].e != c[3 * j] || g[ng - 1].n == MAX_ROWS)
            g[ng++] = (group_t){.e = c[3 * j], .n = 0};
        group_t *q = &g[ng - 1];
        q->rows[q->n] = c[3 * j + 1], q->w[q->n++] = weights[c[3 * j + 1] * k + c[3 * j + 2]];
    }
    for (int64_t a = 0; a < ng; a++) {
        group_t *q = &g[a];
        q->xs = at, q->xp = at + q->n * H, q->act = q->xp + q->n * (H / 8) * 8, q->ap = q->act + q->n * I;
        at = q->ap + q->n * (I / 8) * 8;
        for (int64_t m = 0; m < q->n; m++)
            memcpy(q->xs + m * H, x + q->rows[m] * ldx, sizeof(float) * (size_t)H);
        if (q->n > 1)
            pack(q->xs, H, q->n, H, q->xp);
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < H; n++)
            y[m * ldy + n] = 0.0f;
#pragma omp parallel num_threads(threads) if (ng * 3 * I * H >= GRAIN)
    for (int64_t a = 0; a < ng; a++) {
        const group_t *q = &g[a];
        const float *ge = gu + q->e * ldgu_e, *de = down + q->e * ldd_e;
        int64_t n = q->n;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < I; i++) {
            float gate[MAX_ROWS], up[MAX_ROWS];
            rows_dot(ge + i * ldgu_r, q->xp, q->xs, H, n, H, gate);
            rows_dot(ge + (I + i) * ldgu_r, q->xp, q->xs, H, n, H, up);
            for (int64_t m = 0; m < n; m++) {
                float v = gate[m] / (1.0f + expf(-gate[m])) * up[m];
                q->act[m * I + i] = v;
                if (i < (I / 8) * 8)
                    q->ap[((i / 8) * n + m) * 8 + i % 8] = v; /* pack's layout */
            }
        }
        /* the implicit barrier above: every activation of this group is there */
#pragma omp for schedule(static) nowait
        for (int64_t h = 0; h < H; h++) {
            float out[MAX_ROWS];
            rows_dot(de + h * ldd_r, q->ap, q->act, I, n, I, out);
            for (int64_t m = 0; m < n; m++)
                y[q->rows[m] * ldy + h] += q->w[m] * out[m];
        }
    }
    free(c), free(g), free(scratch);
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

/* A MoE router for one token x (DeepSeek-V3's grouped sigmoid routing): s = sigmoid(W x); the
 * n_group groups ranked by the sum of their two best s + bias, the best topk_group of them kept,
 * and in those the k experts of the largest s + bias; their weights s (normalized to sum 1 when
 * norm), times scaling. Ties go to the earlier group or expert. ids come out ascending, with their
 * weights. s and flags: the caller's scratch (3E + n_group floats, E + n_group bytes). */
static void route_one(const float *x, const float *w, int64_t ldw, const float *bias, int64_t E, int64_t H,
                      int64_t n_group, int64_t topk_group, int64_t k, int norm, float scaling, int64_t *ids,
                      float *weights, int threads, float *s, uint8_t *flags) {
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
}

/* route_one for each of M rows of x (row stride ldx): ids and weights [M, k] */
int pd_route_rows(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias, int64_t E,
                  int64_t H, int64_t n_group, int64_t topk_group, int64_t k, int norm, float scaling, int64_t M,
                  int64_t *ids, float *weights, int threads) {
    float *s = malloc(sizeof(float) * (size_t)(3 * E + n_group + 8));
    uint8_t *flags = malloc((size_t)(E + n_group + 8));
    if (!s || !flags) {
        free(s), free(flags);
        return -1;
    }
    for (int64_t m = 0; m < M; m++)
        route_one(x + m * ldx, w, ldw, bias, E, H, n_group, topk_group, k, norm, scaling, ids + m * k,
                  weights + m * k, threads, s, flags);
    free(s), free(flags);
    return 0;
}
