/* Keyed row hashes on the CPU (transfer/row_mac.py defines them and keeps torch's form for other
 * devices): for each of n rows of `words` signed 16-bit words and each of LANES lanes,
 *     out[i][l] = sum_j k[l][j] * w[i][j] mod P        (P = 2^21 - 9, 0 <= out < P)
 * with k[l][j] in [0, P). Exact in int64: |k w| < 2^36, so SPAN products per vector element and the
 * eight elements' sum stay below 2^63; a row of more words is reduced every SPAN words.
 *
 * Why it exists: the room MAC hashes every byte of a hand-off on both ends, and torch's form (a
 * float64 product per block of rows: an int16 -> float64 copy, then a [3, words] x [words, n] GEMM)
 * reads 1.8-3 GB/s on one core of the 2-core VM; this loop 3.5-4.9 GB/s inside the room MAC
 * (bench/transfer.py's `checksum` line, with and without PDSERVE_NATIVE=0), about half the rate a
 * float32 sum reads at: six multiplies per 8 words bound it. Eight words per step: sign-extended
 * to int32, the even and odd ones multiplied by their coefficients into int64 (two
 * _mm256_mul_epi32), per lane.
 */
#include <immintrin.h>
#include <stdint.h>

#define LANES 3
#define P ((1LL << 21) - 9)
#define SPAN (1LL << 24)
#define GRAIN (1LL << 20) /* words: below this a call runs on the calling thread */

static inline int64_t hsum(__m256i v) {
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1);
}

static inline int64_t modp(int64_t s) {
    s %= P;
    return s < 0 ? s + P : s;
}

/* w: n rows of `words` int16, row i at w + i * ld; k: [LANES][words] int32; out: [n][LANES] int64. */
int pd_row_hash(const int16_t *w, int64_t ld, int64_t n, int64_t words, const int32_t *k, int64_t *out,
                int threads) {
    if (n < 0 || words < 0 || ld < words)
        return -2;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * words >= GRAIN)
    for (int64_t i = 0; i < n; i++) {
        const int16_t *row = w + i * ld;
        int64_t acc[LANES] = {0};
        for (int64_t j0 = 0; j0 < words; j0 += SPAN) {
            int64_t end = words - j0 < SPAN ? words : j0 + SPAN, j = j0;
            __m256i even[LANES], odd[LANES];
            for (int l = 0; l < LANES; l++)
                even[l] = odd[l] = _mm256_setzero_si256();
            for (; j + 8 <= end; j += 8) {
                __m256i x = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(row + j)));
                __m256i xo = _mm256_srli_epi64(x, 32); /* the odd words, in the low halves */
                for (int l = 0; l < LANES; l++) {
                    __m256i kv = _mm256_loadu_si256((const __m256i *)(k + l * words + j));
                    even[l] = _mm256_add_epi64(even[l], _mm256_mul_epi32(x, kv));
                    odd[l] = _mm256_add_epi64(odd[l], _mm256_mul_epi32(xo, _mm256_srli_epi64(kv, 32)));
                }
            }
            for (int l = 0; l < LANES; l++) {
                int64_t s = hsum(even[l]) + hsum(odd[l]);
                for (int64_t t = j; t < end; t++)
                    s += (int64_t)k[l * words + t] * row[t];
                acc[l] = modp(acc[l] + modp(s));
            }
        }
        for (int l = 0; l < LANES; l++)
            out[i * LANES + l] = acc[l];
    }
    return 0;
}
