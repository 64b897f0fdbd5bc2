/* Weight-streaming matrix-vector kernels for decode and short verify blocks on the CPU.
 *
 * Y[m, n] = sum_k X[m, k] * W(n, k) for a few rows of X (M <= 16), weights in the nn.Linear
 * layout [N, K]: fp32, bf16 (raw uint16), or int4 (see gemv_int4). Built by _kernels.py with
 * the system C compiler; GCC vector extensions keep it portable (AVX-512, AVX2 or SSE).
 *
 * Why not the BLAS: at M = 1..9 MKL's sgemm/sgemv reads weights from DRAM at ~8 GB/s on one
 * core here, a third of what a plain sum streams; these read each weight once per call for all
 * M rows and stay near the streaming rate.
 *
 * Each output is a 16-lane accumulation over k in order, then a fixed-order lane sum, so row
 * m's result is bitwise the same whatever M is (a verify block and a decode step agree).
 */
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint8_t v16b __attribute__((vector_size(16), aligned(1)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));


#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, 64); return v; }
static inline v16 ld_bf16(const uint16_t *p) {
#ifdef __AVX512F__
  __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
  return (v16)_mm512_castsi512_ps(u);
#else
  v16h h; memcpy(&h, p, 32);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16 f; memcpy(&f, &u, 64); return f;
#endif
}
/* int4, symmetric: w = (q - 8) * scale. In each run of 32 inputs, byte j holds input j (low
 * nibble) and input j + 16 (high nibble), so one 16-byte load gives two 16-lane vectors. */
static inline void ld_q4(const uint8_t *p, v16 *lo, v16 *hi) {
#ifdef __AVX512F__
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  __m512i eight = _mm512_set1_epi32(8), mask = _mm512_set1_epi32(15);
  *lo = (v16)_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, mask), eight));
  *hi = (v16)_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight));
#else
  v16b b; memcpy(&b, p, 16);
  v16i l = __builtin_convertvector(b & 15, v16i) - 8, h = __builtin_convertvector(b >> 4, v16i) - 8;
  *lo = __builtin_convertvector(l, v16); *hi = __builtin_convertvector(h, v16);
#endif
}
static inline float hsum(v16 a) { float s = 0; for (int j = 0; j < 16; j++) s += a[j]; return s; }

/* One weight row at a time, read front to back (a single sequential stream measured ~30%
 * faster than interleaving 4 rows), for MT input rows at once (MT is a compile-time constant
 * so the 2 x MT accumulators stay in registers), two accumulators per input row (even and odd
 * runs of 16 inputs). K % 32 == 0. */
#define DENSE_MT(NAME, T, LOAD, MT) \
static void NAME##_##MT(const T *w, const float *X, float *Y, int N, int K, int n, int m0) { \
  v16 e[MT], o[MT]; memset(e, 0, sizeof e); memset(o, 0, sizeof o); \
  for (int k = 0; k < K; k += 32) { \
    v16 a = LOAD(w + k), b = LOAD(w + k + 16); \
    for (int m = 0; m < MT; m++) { \
      const float *x = X + (size_t)(m0 + m) * K + k; \
      e[m] += a * ld(x); o[m] += b * ld(x + 16); \
    } \
  } \
  for (int m = 0; m < MT; m++) Y[(size_t)(m0 + m) * N + n] = hsum(e[m] + o[m]); \
}

#define Q4_MT(MT) \
static void q4_##MT(const uint8_t *p, const float *s, const float *X, float *Y, int N, int K, \
                    int G, int n, int m0) { \
  v16 acc[MT]; memset(acc, 0, sizeof acc); \
  for (int g = 0; g < K; g += G, s++) { \
    v16 e[MT], o[MT]; memset(e, 0, sizeof e); memset(o, 0, sizeof o); \
    for (int k = g; k < g + G; k += 32) { \
      v16 lo, hi; ld_q4(p + k / 2, &lo, &hi); \
      for (int m = 0; m < MT; m++) { \
        const float *x = X + (size_t)(m0 + m) * K + k; \
        e[m] += lo * ld(x); o[m] += hi * ld(x + 16); \
      } \
    } \
    for (int m = 0; m < MT; m++) acc[m] += (e[m] + o[m]) * *s; \
  } \
  for (int m = 0; m < MT; m++) Y[(size_t)(m0 + m) * N + n] = hsum(acc[m]); \
}

#define EACH_MT(F, ...) F(__VA_ARGS__, 1) F(__VA_ARGS__, 2) F(__VA_ARGS__, 3) F(__VA_ARGS__, 4) \
  F(__VA_ARGS__, 5) F(__VA_ARGS__, 6) F(__VA_ARGS__, 7) F(__VA_ARGS__, 8)
#define SWITCH_MT(CALL, mt) switch (mt) { \
  case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
  case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); }

EACH_MT(DENSE_MT, gemv_f32, float, ld)
EACH_MT(DENSE_MT, gemv_bf16, uint16_t, ld_bf16)
#define Q4_ONE(unused, MT) Q4_MT(MT)
EACH_MT(Q4_ONE, 0)

#define DENSE_ENTRY(NAME, T) \
void NAME(const T *W, const float *X, float *Y, int M, int N, int K) { \
  for (int n = 0; n < N; n++) { \
    const T *w = W + (size_t)n * K; \
    for (int m0 = 0; m0 < M; m0 += 8) { \
      const int mt = M - m0; \
      SWITCH_MT(NAME##_CALL, mt) \
    } \
  } \
}
#define gemv_f32_CALL(MT) gemv_f32_##MT(w, X, Y, N, K, n, m0)
#define gemv_bf16_CALL(MT) gemv_bf16_##MT(w, X, Y, N, K, n, m0)
DENSE_ENTRY(gemv_f32, float)
DENSE_ENTRY(gemv_bf16, uint16_t)

/* G % 32 == 0; S is [N, K / G] fp32 */
void gemv_int4(const uint8_t *P, const float *S, const float *X, float *Y, int M, int N, int K,
               int G) {
  for (int n = 0; n < N; n++) {
    const uint8_t *p = P + (size_t)n * (K / 2);
    const float *s = S + (size_t)n * (K / G);
    for (int m0 = 0; m0 < M; m0 += 8) {
#define q4_CALL(MT) q4_##MT(p, s, X, Y, N, K, G, n, m0)
      SWITCH_MT(q4_CALL, M - m0)
    }
  }
}
