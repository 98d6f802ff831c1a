/* Keyed row hashes on the CPU (transfer/row_mac.py defines them and keeps torch's form for other
 * devices): Toeplitz NH (UMAC's inner hash) over each row's bytes. A row of L bytes, zero-padded to a
 * multiple of 8, is read as little-endian 32-bit words m_0, m_1, ...; for each lane l < LANES
 *     out[l] = sum_i ((m_2i + k_{SHIFT l + 2i}) mod 2^32) * ((m_2i+1 + k_{SHIFT l + 2i+1}) mod 2^32)  mod 2^64
 * with secret 32-bit key words k. Unsigned arithmetic: every wrap is the definition's.
 *
 * Why NH: the room MAC hashes every byte of a hand-off on both ends. The polynomial hash mod a prime
 * it replaced needed six 32x32 multiplies per 8 16-bit words (3.5-4.9 GB/s on a core of the 2-core
 * VM); NH needs one per 8 bytes per lane: per 32 bytes and lane an add, a shift, a multiply and an
 * add: 13.1 GB/s on a core against the polynomial's 7.0-7.2 (bench/transfer_costs.py `checksum_cost`).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define LANES 2
#define SHIFT 4              /* key words between two lanes' keys (Toeplitz) */
#define GRAIN (1LL << 21)    /* bytes: below this a call runs on the calling thread */

static inline uint64_t hsum(__m256i v) {
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint64_t)_mm_cvtsi128_si64(s) + (uint64_t)_mm_extract_epi64(s, 1);
}

/* rows: n rows of `bytes` bytes, row i at rows + i * ld; k: ceil(bytes / 8) * 2 + SHIFT * (LANES - 1)
 * key words; out: [n][LANES]. */
int pd_row_hash(const uint8_t *rows, int64_t ld, int64_t n, int64_t bytes, const uint32_t *k, uint64_t *out,
                int threads) {
    if (n < 0 || bytes < 0 || (n > 1 && ld < bytes))
        return -2;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * bytes >= GRAIN)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = rows + i * ld;
        __m256i acc[LANES];
        for (int l = 0; l < LANES; l++)
            acc[l] = _mm256_setzero_si256();
        int64_t j = 0;
        for (; j + 32 <= bytes; j += 32) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(row + j));
            for (int l = 0; l < LANES; l++) {
                __m256i t = _mm256_add_epi32(x, _mm256_loadu_si256((const __m256i *)(k + SHIFT * l + j / 4)));
                acc[l] = _mm256_add_epi64(acc[l], _mm256_mul_epu32(t, _mm256_srli_epi64(t, 32)));
            }
        }
        uint64_t s[LANES];
        for (int l = 0; l < LANES; l++)
            s[l] = hsum(acc[l]);
        if (j < bytes) { /* the last < 32 bytes, zero-padded to whole 8-byte pairs */
            uint32_t m[8] = {0};
            memcpy(m, row + j, (size_t)(bytes - j));
            int64_t words = (bytes - j + 7) / 8 * 2;
            for (int l = 0; l < LANES; l++) {
                const uint32_t *kl = k + SHIFT * l + j / 4;
                for (int64_t w = 0; w < words; w += 2)
                    s[l] += (uint64_t)(uint32_t)(m[w] + kl[w]) * (uint32_t)(m[w + 1] + kl[w + 1]);
            }
        }
        for (int l = 0; l < LANES; l++)
            out[i * LANES + l] = s[l];
    }
    return 0;
}
