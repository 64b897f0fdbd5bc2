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
 * Each output is a VL-lane accumulation over k in order, then a fixed-order lane sum, so row
 * m's result is bitwise the same whatever M is (a verify block and a decode step agree).
 *
 * VL is the native vector width: 16 floats with AVX-512, 8 with AVX, else 4 (SSE, NEON).
 * Vectors wider than the hardware's are not kept in registers by GCC: with 64-byte vectors on
 * an AVX2 CPU every accumulator lived on the stack and the fp32 kernel read 6.6 GB/s where
 * F.linear read 18.8 (an SSE-only build, -march=x86-64-v2, runs 4 lanes: 12.1 GB/s).
 * The bits of an output depend on VL, so they agree between rows and steps on one machine, not
 * across machines (nothing compares them across machines).
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4 /* SSE, NEON: 16-byte registers */
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vfi __attribute__((vector_size(VL * 4)));
typedef uint8_t vfb __attribute__((vector_size(VL), aligned(1)));
typedef uint16_t vfh __attribute__((vector_size(VL * 2), aligned(2)));
typedef uint32_t vfu __attribute__((vector_size(VL * 4)));

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* An explicit 64-byte load: from memcpy, GCC tuned for a CPU that prefers 256-bit vectors
 * (-march=native on some AVX-512 machines) builds two 32-byte stores to the stack and one
 * 64-byte reload, a store-forwarding stall per load: the fp32 kernels ran at ~1.2 GFMA/s. */
static inline vf ld(const float *p) {
#ifdef __AVX512F__
  return (vf)_mm512_loadu_ps(p);
#elif defined(__AVX2__)
  return (vf)_mm256_loadu_ps(p);
#else
  vf v; memcpy(&v, p, sizeof v); return v;
#endif
}
static inline void st(float *p, vf v) {
#ifdef __AVX512F__
  _mm512_storeu_ps(p, (__m512)v);
#elif defined(__AVX2__)
  _mm256_storeu_ps(p, (__m256)v);
#else
  memcpy(p, &v, sizeof v);
#endif
}
static inline vf ld_bf16(const uint16_t *p) {
#ifdef __AVX512F__
  __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
  return (vf)_mm512_castsi512_ps(u);
#elif defined(__AVX2__)
  __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
  return (vf)_mm256_castsi256_ps(u);
#else
  vfh h; memcpy(&h, p, sizeof h);
  vfu u = __builtin_convertvector(h, vfu) << 16;
  vf f; memcpy(&f, &u, sizeof f); return f;
#endif
}
/* int4, symmetric: w = (q - 8) * scale. In each run of 32 inputs, byte j holds input j (low
 * nibble) and input j + 16 (high nibble), so a load of VL bytes at byte j gives inputs j.. and
 * j + 16.. as two vectors (VL = 16: the whole run in one load). */
static inline void ld_q4(const uint8_t *p, vf *lo, vf *hi) {
#ifdef __AVX512F__
  /* q - 8 as a float by a table lookup: vpermps reads only the low 4 bits of each index, so a
   * nibble needs no mask, and one permute replaces a mask, a subtract and a conversion (the
   * draft's decode is bound by these instructions, not by its 56 MB of reads). The values are
   * the exact small integers the arithmetic path made, so no output changes. */
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  *lo = (vf)_mm512_permutexvar_ps(b, table);
  *hi = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
#elif defined(__AVX2__)
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
  const __m256i lo4 = _mm256_and_si256(b, _mm256_set1_epi32(15));
  const __m256i hi4 = _mm256_srli_epi32(b, 4);
  *lo = (vf)_mm256_cvtepi32_ps(_mm256_sub_epi32(lo4, _mm256_set1_epi32(8)));
  *hi = (vf)_mm256_cvtepi32_ps(_mm256_sub_epi32(hi4, _mm256_set1_epi32(8)));
#else
  vfb b; memcpy(&b, p, sizeof b);
  vfi l = __builtin_convertvector(b & 15, vfi) - 8, h = __builtin_convertvector(b >> 4, vfi) - 8;
  *lo = __builtin_convertvector(l, vf); *hi = __builtin_convertvector(h, vf);
#endif
}
/* A fixed-order tree: a scalar left-to-right sum of the lanes is a chain of VL dependent
 * adds per output, which measured ~25% of a decode step's gemv time. */
static inline float hsum(vf a) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps((__m512)a);
#else
  float t[VL]; memcpy(t, &a, sizeof t);
  for (int w = VL / 2; w; w >>= 1)
    for (int j = 0; j < w; j++) t[j] += t[j + w];
  return t[0];
#endif
}

/* Weights stream from DRAM while the FMAs of several input rows run: the hardware prefetcher
 * alone keeps too few lines in flight once the loop is compute-heavy, so at 5 rows the reads
 * and the arithmetic added up (57 ms for the target's linears against 27 ms at 1 row). An
 * explicit prefetch into L2, PF_AHEAD bytes ahead of the loads, overlaps them: 5 rows 30-35 ms.
 * Measured on the target's 538 MB of linears, 1 and 5 rows, distances 2-32 KB, L1 or L2 hint:
 * into L1 (T0) at 2 KB gained less (42 ms), 8-32 KB into L2 were alike. A prefetch never
 * faults, so reading past a matrix's end is harmless. One row is bound by the reads alone and
 * the hardware prefetcher keeps up (two whole-model runs timed one-row steps slower with the
 * explicit prefetch), so it has none. */
#define PF_AHEAD 8192
#define PF(p) __builtin_prefetch((const char *)(p) + PF_AHEAD, 0, 1)

/* One weight row at a time, read front to back (a single sequential stream measured ~30%
 * faster than interleaving 4 rows), for MT input rows at once (MT is a compile-time constant
 * so the 2 x MT accumulators stay in registers), two accumulators per input row (even and odd
 * runs of VL inputs). K % 32 == 0. A prefetch per 64-byte line of weights: PF_LINE2 where one
 * step of 2 VL weights spans two lines. */
#define PF_LINE2(T) (sizeof(T) * 2 * VL > 64)
#define DENSE_MT(NAME, T, LOAD, MT) \
static void NAME##_##MT(const T *w, const float *X, float *Y, int N, int K, int n, int m0) { \
  vf e[MT], o[MT]; memset(e, 0, sizeof e); memset(o, 0, sizeof o); \
  for (int k = 0; k < K; k += 2 * VL) { \
    if (MT > 1) { PF(w + k); if (PF_LINE2(T)) PF(w + k + 64 / sizeof(T)); } \
    vf a = LOAD(w + k), b = LOAD(w + k + VL); \
    for (int m = 0; m < MT; m++) { \
      const float *x = X + (size_t)(m0 + m) * K + k; \
      e[m] += a * ld(x); o[m] += b * ld(x + VL); \
    } \
  } \
  for (int m = 0; m < MT; m++) Y[(size_t)(m0 + m) * N + n] = hsum(e[m] + o[m]); \
}

/* Two weight rows a pass for 2-6 input rows (which of them: DENSE2_MAX_MT below): each input
 * vector loaded serves both rows, so a 5-row step makes 14 loads per 20 FMAs where one row a
 * pass made 12 per 10, and the load ports, not the FMAs, were what kept 5 rows at ~1.4x one
 * row's time. Every output's FMAs are DENSE_MT's, in the same order, so the bits are too. */
#define DENSE2_MT(NAME, T, LOAD, MT) \
static void NAME##2_##MT(const T *w, const float *X, float *Y, int N, int K, int n, int m0) { \
  const T *w1 = w + K; \
  vf e0[MT], o0[MT], e1[MT], o1[MT]; \
  memset(e0, 0, sizeof e0); memset(o0, 0, sizeof o0); \
  memset(e1, 0, sizeof e1); memset(o1, 0, sizeof o1); \
  for (int k = 0; k < K; k += 2 * VL) { \
    PF(w + k); PF(w1 + k); \
    if (PF_LINE2(T)) { PF(w + k + 64 / sizeof(T)); PF(w1 + k + 64 / sizeof(T)); } \
    const vf a0 = LOAD(w + k), a1 = LOAD(w1 + k); \
    for (int m = 0; m < MT; m++) { \
      const vf x = ld(X + (size_t)(m0 + m) * K + k); \
      e0[m] += a0 * x; e1[m] += a1 * x; \
    } \
    const vf b0 = LOAD(w + k + VL), b1 = LOAD(w1 + k + VL); \
    for (int m = 0; m < MT; m++) { \
      const vf x = ld(X + (size_t)(m0 + m) * K + k + VL); \
      o0[m] += b0 * x; o1[m] += b1 * x; \
    } \
  } \
  for (int m = 0; m < MT; m++) { \
    Y[(size_t)(m0 + m) * N + n] = hsum(e0[m] + o0[m]); \
    Y[(size_t)(m0 + m) * N + n + 1] = hsum(e1[m] + o1[m]); \
  } \
}

/* GS is the group size: the common 64 as a constant (the group's two steps unrolled, the
 * accumulators kept in registers across groups), any other multiple of 32 at run time. */
#define Q4_BODY(MT, GS) { \
  vf acc[MT]; memset(acc, 0, sizeof acc); \
  for (int g = 0; g < K; g += GS, s++) { \
    vf e[MT], o[MT]; memset(e, 0, sizeof e); memset(o, 0, sizeof o); \
    for (int k = g; k < g + GS; k += 32) \
      for (int j = 0; j < 16; j += VL) { \
        vf lo, hi; ld_q4(p + (unsigned)k / 2 + j, &lo, &hi); \
        for (int m = 0; m < MT; m++) { \
          const float *x = X + (size_t)(m0 + m) * K + k + j; \
          e[m] += lo * ld(x); o[m] += hi * ld(x + 16); \
        } \
      } \
    for (int m = 0; m < MT; m++) acc[m] += (e[m] + o[m]) * *s; \
  } \
  for (int m = 0; m < MT; m++) Y[(size_t)(m0 + m) * N + n] = hsum(acc[m]); \
}
#define Q4_MT(MT) \
static void q4_##MT(const uint8_t *p, const float *s, const float *X, float *Y, int N, int K, \
                    int G, int n, int m0) { \
  if (G == 64) Q4_BODY(MT, 64) else Q4_BODY(MT, G) \
}

#define EACH_MT(F, ...) F(__VA_ARGS__, 1) F(__VA_ARGS__, 2) F(__VA_ARGS__, 3) F(__VA_ARGS__, 4) \
  F(__VA_ARGS__, 5) F(__VA_ARGS__, 6) F(__VA_ARGS__, 7) F(__VA_ARGS__, 8)
#define SWITCH_MT(CALL, mt) switch (mt) { \
  case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
  case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); }

EACH_MT(DENSE_MT, gemv_f32, float, ld)
EACH_MT(DENSE_MT, gemv_bf16, uint16_t, ld_bf16)
#define DENSE2_EACH(NAME, T, LOAD) DENSE2_MT(NAME, T, LOAD, 2) DENSE2_MT(NAME, T, LOAD, 3) \
  DENSE2_MT(NAME, T, LOAD, 4) DENSE2_MT(NAME, T, LOAD, 5) DENSE2_MT(NAME, T, LOAD, 6)
DENSE2_EACH(gemv_f32, float, ld)
DENSE2_EACH(gemv_bf16, uint16_t, ld_bf16)
#define Q4_ONE(unused, MT) Q4_MT(MT)
EACH_MT(Q4_ONE, 0)

/* More than 8 rows: a block of weight rows stays in L2 while each group of 8 input rows runs
 * over it from L1 (row by row over all of X, 50 rows of 1,536 inputs were 300 KB re-read from
 * L2 per weight row: 20 GFMA/s against 37 in cache). The order of work changes, not any
 * output's arithmetic. */
#ifndef BLOCK_BYTES
#define BLOCK_BYTES (128 * 1024)
#endif
/* Two weight rows a pass (DENSE2) need 4 x MT accumulators: past 3 rows they outgrow the 16
 * registers of AVX2 (and SSE, NEON) and spill, and one weight row a pass (13 registers at 5
 * rows) ran the q/k/v/o/gate/up shapes (576 inputs) 10-20 % faster at 4-6 rows, from DRAM and
 * from cache alike. With wide inputs (down_proj: 1,536) the rows of X no longer fit beside the
 * weights in L1, and DENSE2, reading X half as often, stayed ~15 % the faster: it keeps those. */
#ifndef X_L1_BYTES
#define X_L1_BYTES (16 * 1024)
#endif
#if VL == 16 /* AVX-512: 32 registers hold DENSE2's 24 accumulators at 6 rows */
#define DENSE2_MAX_MT(K, mt) 6
#else
#define DENSE2_MAX_MT(K, mt) ((K) * (int)sizeof(float) * (mt) > X_L1_BYTES ? 6 : 3)
#endif
#define DENSE_ENTRY(NAME, T) \
void NAME(const T *W, const float *X, float *Y, int M, int N, int K) { \
  const int groups = (M + 7) / 8; /* balanced (9 rows: 5 + 4, not 8 + 1) */ \
  int nb = groups == 1 ? N : BLOCK_BYTES / (K * (int)sizeof(T)); \
  if (nb < 1) nb = 1; \
  for (int n0 = 0; n0 < N; n0 += nb) { \
    const int n1 = n0 + nb < N ? n0 + nb : N; \
    for (int g = 0, m0 = 0; g < groups; g++) { \
      const int mt = (M - m0) / (groups - g); \
      int n = n0; \
      if (mt >= 2 && mt <= DENSE2_MAX_MT(K, mt)) \
        for (; n + 2 <= n1; n += 2) { \
          const T *w = W + (size_t)n * K; \
          switch (mt) { \
          case 2: NAME##2_2(w, X, Y, N, K, n, m0); break; \
          case 3: NAME##2_3(w, X, Y, N, K, n, m0); break; \
          case 4: NAME##2_4(w, X, Y, N, K, n, m0); break; \
          case 5: NAME##2_5(w, X, Y, N, K, n, m0); break; \
          default: NAME##2_6(w, X, Y, N, K, n, m0); } \
        } \
      for (; n < n1; n++) { \
        const T *w = W + (size_t)n * K; \
        SWITCH_MT(NAME##_CALL, mt) \
      } \
      m0 += mt; \
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
  const int groups = (M + 7) / 8;
  for (int n = 0; n < N; n++) {
    const uint8_t *p = P + (size_t)n * (K / 2);
    const float *s = S + (size_t)n * (K / G);
    for (int g = 0, m0 = 0; g < groups; g++) {
#define q4_CALL(MT) q4_##MT(p, s, X, Y, N, K, G, n, m0)
      const int mt = (M - m0) / (groups - g);
      SWITCH_MT(q4_CALL, mt)
      m0 += mt;
    }
  }
}

/* ---------------------------------------------------------------------------------------------
 * int4 weights x int8 activations (the draft's decode steps): gemv_q4a8.
 *
 * Why: the fp32 path above turns every nibble into a float (a conversion, two permutes) before
 * its FMA, and the draft's decode step is bound by those instructions, not by its reads. With
 * AVX-512 VNNI one vpdpbusd multiplies 64 unsigned nibbles by 64 int8 activations and sums them
 * in fours into 16 int32 lanes, exactly. The only rounding added is the activations' (one int8
 * scale per group of 64 inputs, round to nearest: |error| <= scale / 2 per input, the usual
 * Q8 activations of llama.cpp's int4 paths). Only a draft uses it: its outputs are proposals
 * the target verifies, so its numerics move acceptance, never what is committed.
 *
 * Per row the activations are quantized once per call into the weights' nibble order: in a
 * chunk of 128 inputs (64 weight bytes; 64 at the end when K % 128 == 64) byte b of the low
 * plane is input 32 (b / 16) + b % 16 and of the high plane that + 16, so lanes 0-7 of a chunk
 * belong to its first group and 8-15 to its second. The weights' offset (q - 8) goes in as
 * -8 x the lane's activation sum, the lane's starting value. Each row's arithmetic is the same
 * whatever M is. Without VNNI (or for a group size other than 64) it is gemv_int4. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__)
#define HAVE_Q4A8 1

/* A group of 64 inputs loaded into v, and its largest magnitude (the int8 scale's amax). */
static inline float load_group(const float *x, __m512 v[4]) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < 4; i++) {
    v[i] = _mm512_loadu_ps(x + 16 * i);
    m = _mm512_max_ps(m, _mm512_and_ps(v[i], magnitude));
  }
  return _mm512_reduce_max_ps(m);
}

/* One row: xq [K] int8 in nibble order, co [K / 8] lane offsets, sx [K / 8] lane scales. A run of
 * 16 inputs lands contiguously (at h * lo_bytes + 16 r of its chunk), so each is one vector
 * convert and store; the lane offsets are the activations' sums in fours, a vpdpbusd with ones.
 * The scalar loop this replaces took 3.6 us at K = 576, 7 calls a layer: ~1 ms of a 12 ms
 * draft step. _mm512_cvtps_epi32 rounds to nearest even as lrintf does. */
static void q8_row(const float *x, int K, int8_t *xq, int32_t *co, float *sx) {
  for (int g = 0; g < K; g += 64) {
    __m512 v[4];
    const float amax = load_group(x + g, v);
    const float scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    const int k0 = g & ~127, lo_bytes = (K - k0 >= 128 ? 64 : 32);
    const __m512 vi = _mm512_set1_ps(inv);
    for (int i = 0; i < 4; i++) {
      const int rel = g - k0 + 16 * i, r = rel / 32, h = (rel % 32) / 16;
      const __m128i b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], vi)));
      _mm_storeu_si128((__m128i *)(xq + k0 + h * lo_bytes + 16 * r), b);
    }
    _mm256_storeu_ps(sx + g / 8, _mm256_set1_ps(scale));
  }
  int k0 = 0;
  for (; k0 + 128 <= K; k0 += 128) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(xq + k0));
    t = _mm512_dpbusd_epi32(t, ones, _mm512_loadu_si512(xq + k0 + 64));
    _mm512_storeu_si512(co + k0 / 8, _mm512_mullo_epi32(t, _mm512_set1_epi32(-8)));
  }
  if (k0 < K) {
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones,
                                    _mm256_loadu_si256((const __m256i *)(xq + k0)));
    t = _mm256_dpbusd_epi32(t, ones, _mm256_loadu_si256((const __m256i *)(xq + k0 + 32)));
    _mm256_storeu_si256((__m256i *)(co + k0 / 8), _mm256_mullo_epi32(t, _mm256_set1_epi32(-8)));
  }
}

/* The sums of four accumulators by one fixed tree: lane i + lane i + 8, then pairs, then the
 * two halves. q8_4rows reduces four weight rows at once with it, q8_MT one row (the same tree
 * on one input), so an output's bits do not depend on how it was computed. */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
#define HALVES(a) _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1))
  const __m256 h01 = _mm256_hadd_ps(HALVES(a0), HALVES(a1));
  const __m256 h23 = _mm256_hadd_ps(HALVES(a2), HALVES(a3));
#undef HALVES
  const __m256 h = _mm256_hadd_ps(h01, h23);
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
static inline float sum1(__m512 a) { return _mm_cvtss_f32(sum4(a, a, a, a)); }

/* The weight group scales of a chunk: lanes 0-7 the first group's, 8-15 the second's. */
static inline __m512 chunk_scales(const float *s) {
  return _mm512_mask_broadcastss_ps(_mm512_set1_ps(s[0]), 0xFF00, _mm_load_ss(s + 1));
}

#define Q8_MT(MT) \
static void q8_##MT(const uint8_t *p, const float *s, const int8_t *XQ, const int32_t *CO, \
                    const float *SX, float *Y, int N, int K, int n, int m0) { \
  __m512 acc[MT]; \
  for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps(); \
  const __m512i nib = _mm512_set1_epi8(15); \
  int k = 0; \
  for (; k + 128 <= K; k += 128) { \
    const __m512i w = _mm512_loadu_si512((const void *)(p + k / 2)); \
    const __m512i lo = _mm512_and_si512(w, nib); \
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib); \
    const __m512 sw = chunk_scales(s + k / 64); \
    for (int m = 0; m < MT; m++) { \
      const size_t r = (size_t)(m0 + m); \
      const int8_t *xq = XQ + r * K + k; \
      __m512i a = _mm512_loadu_si512((const void *)(CO + r * (K / 8) + k / 8)); \
      a = _mm512_dpbusd_epi32(a, lo, _mm512_loadu_si512((const void *)xq)); \
      a = _mm512_dpbusd_epi32(a, hi, _mm512_loadu_si512((const void *)(xq + 64))); \
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(a), \
                                     _mm512_loadu_ps(SX + r * (K / 8) + k / 8)); \
      acc[m] = _mm512_fmadd_ps(f, sw, acc[m]); \
    } \
  } \
  if (k < K) { /* the last 64 inputs: half a chunk */ \
    const __m256i w = _mm256_loadu_si256((const __m256i *)(p + k / 2)); \
    const __m256i nib8 = _mm256_set1_epi8(15); \
    const __m256i lo = _mm256_and_si256(w, nib8); \
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib8); \
    const __m256 sw = _mm256_set1_ps(s[k / 64]); \
    for (int m = 0; m < MT; m++) { \
      const size_t r = (size_t)(m0 + m); \
      const int8_t *xq = XQ + r * K + k; \
      __m256i a = _mm256_loadu_si256((const __m256i *)(CO + r * (K / 8) + k / 8)); \
      a = _mm256_dpbusd_epi32(a, lo, _mm256_loadu_si256((const __m256i *)xq)); \
      a = _mm256_dpbusd_epi32(a, hi, _mm256_loadu_si256((const __m256i *)(xq + 32))); \
      const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(a), \
                                     _mm256_loadu_ps(SX + r * (K / 8) + k / 8)); \
      acc[m] = _mm512_add_ps(acc[m], _mm512_zextps256_ps512(_mm256_mul_ps(f, sw))); \
    } \
  } \
  for (int m = 0; m < MT; m++) Y[(size_t)(m0 + m) * N + n] = sum1(acc[m]); \
}
#define Q8_ONE(unused, MT) Q8_MT(MT)
EACH_MT(Q8_ONE, 0)

/* One input row (a decode step), four weight rows a pass: the row's activations, offsets and
 * scales are loaded once for all four, and the four sums come out of one sum4. At K = 576
 * (4.5 chunks a weight row) the per-row loads and the lane sum were a third of the work:
 * 1,536 x 576 in cache 28.5 -> 25.2 us, 576 x 576 17.5 -> 12.5 us. Every output's arithmetic
 * is q8_1's, chunk by chunk, and so are its bits. */
static void q8_4rows(const uint8_t *P, const float *S, const int8_t *xq, const int32_t *co,
                     const float *sx, float *Y, int n, int K) {
  const __m512i nib = _mm512_set1_epi8(15);
  const uint8_t *p[4];
  const float *s[4];
  __m512 acc[4];
  for (int r = 0; r < 4; r++) {
    p[r] = P + (size_t)(n + r) * (K / 2);
    s[r] = S + (size_t)(n + r) * (K / 64);
    acc[r] = _mm512_setzero_ps();
  }
  int k = 0;
  for (; k + 128 <= K; k += 128) {
    const __m512i x0 = _mm512_loadu_si512((const void *)(xq + k));
    const __m512i x1 = _mm512_loadu_si512((const void *)(xq + k + 64));
    const __m512i c = _mm512_loadu_si512((const void *)(co + k / 8));
    const __m512 fx = _mm512_loadu_ps(sx + k / 8);
    for (int r = 0; r < 4; r++) {
      PF(p[r] + k / 2);
      const __m512i w = _mm512_loadu_si512((const void *)(p[r] + k / 2));
      const __m512i lo = _mm512_and_si512(w, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
      __m512i a = _mm512_dpbusd_epi32(c, lo, x0);
      a = _mm512_dpbusd_epi32(a, hi, x1);
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(a), fx);
      acc[r] = _mm512_fmadd_ps(f, chunk_scales(s[r] + k / 64), acc[r]);
    }
  }
  if (k < K) { /* the last 64 inputs: half a chunk */
    const __m256i nib8 = _mm256_set1_epi8(15);
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + k));
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + k + 32));
    const __m256i c = _mm256_loadu_si256((const __m256i *)(co + k / 8));
    const __m256 fx = _mm256_loadu_ps(sx + k / 8);
    for (int r = 0; r < 4; r++) {
      const __m256i w = _mm256_loadu_si256((const __m256i *)(p[r] + k / 2));
      const __m256i lo = _mm256_and_si256(w, nib8);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib8);
      __m256i a = _mm256_dpbusd_epi32(c, lo, x0);
      a = _mm256_dpbusd_epi32(a, hi, x1);
      const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(a), fx);
      const __m256 sw = _mm256_set1_ps(s[r][k / 64]);
      acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(_mm256_mul_ps(f, sw)));
    }
  }
  _mm_storeu_ps(Y + n, sum4(acc[0], acc[1], acc[2], acc[3]));
}

/* ---------------------------------------------------------------------------------------------
 * The draft's decode layout: gemv_q4a8i, weights in blocks of four rows (interleave_q4 in
 * _kernels.py). Why: in gemv_q4a8 each 64-byte load held two half groups of one row, so every
 * load paid its own float conversion and two scale broadcasts, and the four rows a pass were
 * four streams; it read DRAM at ~9-10 GB/s, a third of a plain sum. Here one 64-byte load holds
 * the same 32 inputs of four rows (a 16-byte run each, one per 128-bit lane), the activations go
 * in as one 16-byte run broadcast to all lanes, and a group's integer sums stay in int32 for
 * both of its runs: one conversion and one scale per group of 64 inputs and four rows. The
 * weights are one sequential stream. Harness over 56 MB of int4: ~15-19 GB/s.
 *
 * Layout, for rows 4b..4b+3: byte 64 t + 16 r + j of the block is byte 16 t + j of row 4b + r
 * in pack_int4's layout (run t of 32 inputs); scales [N / 4][K / 64][4]. Activations: int8 per
 * group of 64 in natural order (scale amax / 127, round to nearest even, as q8_row), the group's
 * offset -8 x its sum added in lane 0 of each row. Each row's arithmetic is the same whatever M
 * is. Outputs differ from gemv_q4a8's by float rounding only (integer sums are exact). */
static void q8_natural(const float *x, int K, int8_t *xq, int32_t *cg, float *sx) {
  for (int g = 0; g < K; g += 64) {
    __m512 v[4];
    const float amax = load_group(x + g, v);
    const __m512 vi = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], vi));
      sum = _mm512_add_epi32(sum, q);
      _mm_storeu_si128((__m128i *)(xq + g + 16 * i), _mm512_cvtepi32_epi8(q));
    }
    sx[g / 64] = amax / 127.0f;
    cg[g / 64] = -8 * _mm512_reduce_add_epi32(sum);
  }
}

/* The four outputs of one block for one input row. */
static inline __m128 q8i_block(const uint8_t *p, const float *s, const int8_t *xq,
                               const int32_t *cg, const float *sx, int K) {
  const __m512i nib = _mm512_set1_epi8(15);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc = _mm512_setzero_ps();
  for (int g = 0; g < K / 64; g++, p += 128, s += 4) {
    __m512i a = _mm512_maskz_set1_epi32(0x1111, cg[g]);
    for (int t = 0; t < 2; t++) {
      const __m512i w = _mm512_loadu_si512((const void *)(p + 64 * t));
      const int8_t *x = xq + 64 * g + 32 * t;
      a = _mm512_dpbusd_epi32(a, _mm512_and_si512(w, nib),
                              _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x)));
      a = _mm512_dpbusd_epi32(a, _mm512_and_si512(_mm512_srli_epi16(w, 4), nib),
                              _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x + 16))));
    }
    const __m512 sw = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(s)));
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(sx[g])), sw, acc);
  }
  /* each 128-bit lane (one row) summed as (l0 + l1) + (l2 + l3) */
  __m512 y = _mm512_add_ps(acc, _mm512_permute_ps(acc, _MM_SHUFFLE(2, 3, 0, 1)));
  y = _mm512_add_ps(y, _mm512_permute_ps(y, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, y));
}
#else
#define HAVE_Q4A8 0
#endif

/* The same int8 activations on AVX2 (no VNNI), as llama.cpp's AVX2 Q4 x Q8 dot products do
 * it: vpmaddubsw multiplies 32 unsigned nibbles by 32 int8 activations into 16 int16 pairs
 * (at most 2 x 15 x 127, no saturation), vpmaddwd with ones sums them into 8 int32 lanes,
 * exactly. The weights stay in pack_int4's row-major runs of 32: the low nibbles of a run's 16
 * bytes are its inputs 0-15 and the high ones 16-31, so one run is one 32-byte vector in input
 * order and the activations stay in their natural order. Per group of 64 the lanes go to fp32
 * once (times the weight's and the activations' scales), and the weights' offset (q - 8) as -8
 * x the group's activation sum. The rounding is the VNNI path's, so is the error bound. */
#if !HAVE_Q4A8 && defined(__AVX2__) && defined(__FMA__)
#define HAVE_Q4A8_AVX2 1

/* Row x [K] to int8 per group of 64 (scale amax / 127, round to nearest even): xq [K], the
 * group sums cs [K / 64] and scales sx [K / 64]. */
static void q8_groups(const float *x, int K, int8_t *xq, int32_t *cs, float *sx) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int g = 0; g < K; g += 64) {
    __m256 v[8], m = _mm256_setzero_ps();
    for (int i = 0; i < 8; i++) {
      v[i] = _mm256_loadu_ps(x + g + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(v[i], magnitude));
    }
    float t[8];
    _mm256_storeu_ps(t, m);
    float amax = 0;
    for (int i = 0; i < 8; i++) amax = t[i] > amax ? t[i] : amax;
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i sum = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
      __m256i q[4];
      for (int i = 0; i < 4; i++) {
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[4 * h + i], vi));
        sum = _mm256_add_epi32(sum, q[i]);
      }
      /* packs work within 128-bit lanes: the permute puts the 32 bytes back in order */
      const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                           _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256((__m256i *)(xq + g + 32 * h), _mm256_permutevar8x32_epi32(b, order));
    }
    int32_t st32[8];
    _mm256_storeu_si256((__m256i *)st32, sum);
    int32_t total = 0;
    for (int i = 0; i < 8; i++) total += st32[i];
    cs[g / 64] = total;
    sx[g / 64] = amax / 127.0f;
  }
}

static inline __m256i q4_run32(const uint8_t *p) {
  const __m128i b = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

#define Q8A2_MT(MT) \
static void q8a2_##MT(const uint8_t *p, const float *s, const int8_t *xq, const int32_t *cs, \
                      const float *sx, float *Y, int N, int K, int n, int m0) { \
  const int G = K / 64; \
  const __m256i ones = _mm256_set1_epi16(1); \
  __m256 acc[MT]; float off[MT]; \
  for (int m = 0; m < MT; m++) { acc[m] = _mm256_setzero_ps(); off[m] = 0; } \
  for (int g = 0; g < G; g++) { \
    const __m256i w0 = q4_run32(p + 32 * g), w1 = q4_run32(p + 32 * g + 16); \
    for (int m = 0; m < MT; m++) { \
      const int8_t *x = xq + (size_t)(m0 + m) * K + 64 * g; \
      const __m256i d = _mm256_add_epi16( \
          _mm256_maddubs_epi16(w0, _mm256_loadu_si256((const __m256i *)x)), \
          _mm256_maddubs_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 32)))); \
      const float sc = s[g] * sx[(size_t)(m0 + m) * G + g]; \
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d, ones)), \
                               _mm256_set1_ps(sc), acc[m]); \
      off[m] += sc * (float)cs[(size_t)(m0 + m) * G + g]; \
    } \
  } \
  for (int m = 0; m < MT; m++) Y[(size_t)(m0 + m) * N + n] = hsum((vf)acc[m]) - 8.0f * off[m]; \
}
#define Q8A2_ONE(unused, MT) Q8A2_MT(MT)
EACH_MT(Q8A2_ONE, 0)

/* 0, or -1 (nothing written) when out of memory */
static int gemv_q4a8_avx2(const uint8_t *P, const float *S, const float *X, float *Y, int M,
                          int N, int K) {
  const int G = K / 64;
  char *buf = malloc((size_t)M * (K + 8 * G));
  if (!buf) return -1;
  int32_t *cs = (int32_t *)buf;
  float *sx = (float *)(cs + (size_t)M * G);
  int8_t *xq = (int8_t *)(sx + (size_t)M * G);
  for (int m = 0; m < M; m++)
    q8_groups(X + (size_t)m * K, K, xq + (size_t)m * K, cs + (size_t)m * G, sx + (size_t)m * G);
  const int groups = (M + 7) / 8;
  for (int n = 0; n < N; n++) {
    const uint8_t *p = P + (size_t)n * (K / 2);
    const float *s = S + (size_t)n * G;
    for (int g = 0, m0 = 0; g < groups; g++) {
#define q8a2_CALL(MT) q8a2_##MT(p, s, xq, cs, sx, Y, N, K, n, m0)
      const int mt = (M - m0) / (groups - g);
      SWITCH_MT(q8a2_CALL, mt)
      m0 += mt;
    }
  }
  free(buf);
  return 0;
}
#else
#define HAVE_Q4A8_AVX2 0
#endif

/* N % 4 == 0, K % 64 == 0, group size 64; returns -1 (nothing written) without VNNI or memory:
 * callers check q4a8_native() first. */
int gemv_q4a8i(const uint8_t *P, const float *S, const float *X, float *Y, int M, int N, int K) {
#if HAVE_Q4A8
  if (N % 4 || K % 64) return -1;
  const int G = K / 64;
  char *buf = malloc((size_t)M * (K + 8 * G));
  if (!buf) return -1;
  int32_t *cg = (int32_t *)buf;
  float *sx = (float *)(cg + (size_t)M * G);
  int8_t *xq = (int8_t *)(sx + (size_t)M * G);
  for (int m = 0; m < M; m++)
    q8_natural(X + (size_t)m * K, K, xq + (size_t)m * K, cg + (size_t)m * G, sx + (size_t)m * G);
  for (int b = 0; b < N / 4; b++) {
    const uint8_t *p = P + (size_t)b * 2 * K;
    const float *s = S + (size_t)b * 4 * G;
    for (int m = 0; m < M; m++)
      _mm_storeu_ps(Y + (size_t)m * N + 4 * b,
                    q8i_block(p, s, xq + (size_t)m * K, cg + (size_t)m * G, sx + (size_t)m * G, K));
  }
  free(buf);
  return 0;
#else
  (void)P; (void)S; (void)X; (void)Y; (void)M; (void)N; (void)K;
  return -1;
#endif
}

/* 2: int8 activations on VNNI, row-major and in blocks of four rows (gemv_q4a8i); 1: on AVX2,
 * row-major only; 0: gemv_q4a8 is gemv_int4 */
int q4a8_native(void) { return HAVE_Q4A8 ? 2 : HAVE_Q4A8_AVX2; }
int vec_lanes(void) { return VL; }

void gemv_q4a8(const uint8_t *P, const float *S, const float *X, float *Y, int M, int N, int K,
               int G) {
#if HAVE_Q4A8
  if (G == 64 && K % 64 == 0) {
    const size_t lanes = (size_t)M * (K / 8);
    char *buf = malloc((size_t)M * K + lanes * 8);
    if (buf) {
      int32_t *co = (int32_t *)buf;
      float *sx = (float *)(co + lanes);
      int8_t *xq = (int8_t *)(sx + lanes);
      for (int m = 0; m < M; m++)
        q8_row(X + (size_t)m * K, K, xq + (size_t)m * K, co + (size_t)m * (K / 8),
               sx + (size_t)m * (K / 8));
      const int groups = (M + 7) / 8;
      int n = 0;
      if (M == 1)
        for (; n + 4 <= N; n += 4) q8_4rows(P, S, xq, co, sx, Y, n, K);
      for (; n < N; n++) {
        const uint8_t *p = P + (size_t)n * (K / 2);
        const float *s = S + (size_t)n * (K / G);
        for (int g = 0, m0 = 0; g < groups; g++) {
#define q8_CALL(MT) q8_##MT(p, s, xq, co, sx, Y, N, K, n, m0)
          const int mt = (M - m0) / (groups - g);
          SWITCH_MT(q8_CALL, mt)
          m0 += mt;
        }
      }
      free(buf);
      return;
    }
  }
#endif
#if HAVE_Q4A8_AVX2
  if (G == 64 && K % 64 == 0 && gemv_q4a8_avx2(P, S, X, Y, M, N, K) == 0) return;
#endif
  gemv_int4(P, S, X, Y, M, N, K, G);
}

/* ---------------------------------------------------------------------------------------------
 * A whole Llama decoder stack for a few rows (decode steps, verify blocks), in one call.
 *
 * Per row and layer the torch path runs ~40 small ops (norms, rotary, SDPA, SiLU, residuals),
 * each a dispatch of a few microseconds: at 30 layers that is several milliseconds per token,
 * the size of the whole memory floor of a small draft. Here they are plain loops between the
 * weight-streaming calls above. Every row's arithmetic is independent of the others, so a row
 * gives the same bits in a verify block of k rows as in a decode step of its own.
 *
 * Row m: batch row rb[m] of the KV buffer, written at slot rslot[m], attending over slots
 * [rlo[m], rslot[m]] of that batch row (causal within a block: all rows write first).
 * KV buffer: element strides per layer, key/value, batch row, KV head, slot; head_dim contiguous.
 */

typedef struct {
  int32_t kind; /* 0 fp32, 1 bf16, 2 int4 (symmetric, see gemv_int4), 3 int4 x int8 (gemv_q4a8),
                 * 4 the same in blocks of four rows (gemv_q4a8i) */
  int32_t N, K, G;
  const void *w;
  const float *s;
  const float *p; /* kind 0: the weight packed in panels (gemm_panels) for prefill, or NULL */
} lin_t;

/* 0, or -1 when a kernel could not run (out of memory; the plan checks shapes and VNNI) */
void gemm_panels(const float *P, const float *X, float *Y, int M, int N, int K, int threads);

/* More rows than this take the prefill kernels (gemm_panels, attend_tiles), whose results are
 * float rounding away from the exact ones; up to it a row's bits equal a one-token step's. */
#define EXACT_ROWS 16

static int lin_apply(const lin_t *L, const float *X, float *Y, int M, int threads) {
  if (L->kind == 0 && L->p && M > EXACT_ROWS) gemm_panels(L->p, X, Y, M, L->N, L->K, threads);
  else if (L->kind == 0) gemv_f32((const float *)L->w, X, Y, M, L->N, L->K);
  else if (L->kind == 1) gemv_bf16((const uint16_t *)L->w, X, Y, M, L->N, L->K);
  else if (L->kind == 2) gemv_int4((const uint8_t *)L->w, L->s, X, Y, M, L->N, L->K, L->G);
  else if (L->kind == 3) gemv_q4a8((const uint8_t *)L->w, L->s, X, Y, M, L->N, L->K, L->G);
  else return gemv_q4a8i((const uint8_t *)L->w, L->s, X, Y, M, L->N, L->K);
  return 0;
}

/* As transformers' LlamaRMSNorm in fp32: y = w * (x / sqrt(mean(x^2) + eps)) */
static void rmsnorm(const float *x, const float *w, float *y, int H, float eps) {
  float ss = 0;
  for (int i = 0; i < H; i++) ss += x[i] * x[i];
  const float r = 1.0f / sqrtf(ss / H + eps);
  for (int i = 0; i < H; i++) y[i] = w[i] * (x[i] * r);
}

/* The final norm of the fast path, over M rows of H (the C stack's output before the lm_head):
 * in torch it was ~0.2 ms of dispatch per decode step for 576 numbers. */
void rms_norm_rows(const float *x, const float *w, float *y, int M, int H, float eps) {
  for (int m = 0; m < M; m++) rmsnorm(x + (size_t)m * H, w, y + (size_t)m * H, H, eps);
}

/* SiLU(g) * u over n values. Its expf was ~0.8 ms of a 5-row verify step (30 layers x 1,536 x 5
 * calls to libm); with AVX-512 sixteen at a time by Cephes' expf polynomial (relative error
 * under 2e-7, i.e. 1-2 ulp, as libm's; the bits differ from torch's, the tolerance of the fast
 * path's tests covers it). The same code for every row, so a row's bits still do not depend
 * on the rows beside it. */
#ifdef __AVX512F__
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.72283f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same polynomial eight at a time. AVX2 has no scalef: 2^n is built in the exponent bits,
 * so x is clamped at 88 (n <= 127; exp(88) = 1.65e38), not 88.72; only SiLU of inputs below -88
 * sees that, and its output rounds to -0 either way. */
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
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
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

static void silu_mul(float *g, const float *u, size_t n) {
  size_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)),
                                          _mm512_loadu_ps(u + i)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)),
                                          _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* sc[j] = exp(sc[j] - mx) for j < n; returns their sum (softmax's numerator and denominator),
 * sixteen at a time with AVX-512, eight with AVX2 (as silu_mul; sums in lanes, then one fixed
 * tree). */
static float exp_shifted_sum(float *sc, int n, float mx) {
  int j = 0;
  float sum = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), m));
    _mm512_storeu_ps(sc + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  vf acc = {0};
  const __m256 m = _mm256_set1_ps(mx);
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m));
    _mm256_storeu_ps(sc + j, e);
    acc += (vf)e;
  }
  sum = hsum(acc);
#endif
  for (; j < n; j++) sum += (sc[j] = expf(sc[j] - mx));
  return sum;
}

/* rotate_half convention: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), halves of head_dim */
static void rope(float *x, int heads, int hd, const float *c, const float *s) {
  const int h2 = hd / 2;
  for (int h = 0; h < heads; h++, x += hd) {
    for (int i = 0; i < h2; i++) {
      const float a = x[i], b = x[i + h2];
      x[i] = a * c[i] - b * s[i];
      x[i + h2] = b * c[i + h2] + a * s[i + h2];
    }
  }
}

static float dot(const float *a, const float *b, int n) {
  vf acc = {0};
  for (int i = 0; i < n; i += VL) acc += ld(a + i) * ld(b + i);
  return hsum(acc);
}

/* sc[0..3] = hsum(a0..a3) * scale: the AVX2 path does hsum's tree for four sums in four vector
 * adds and a transpose (the same pairs in the same order, so the same bits); the scalar tree
 * per sum took as long as the dot products themselves at 64-wide heads. */
static inline void hsum4(vf a0, vf a1, vf a2, vf a3, float scale, float *sc) {
#if VL == 8 && defined(__AVX__)
  __m128 s0 = _mm_add_ps(_mm256_castps256_ps128((__m256)a0), _mm256_extractf128_ps((__m256)a0, 1));
  __m128 s1 = _mm_add_ps(_mm256_castps256_ps128((__m256)a1), _mm256_extractf128_ps((__m256)a1, 1));
  __m128 s2 = _mm_add_ps(_mm256_castps256_ps128((__m256)a2), _mm256_extractf128_ps((__m256)a2, 1));
  __m128 s3 = _mm_add_ps(_mm256_castps256_ps128((__m256)a3), _mm256_extractf128_ps((__m256)a3, 1));
  _MM_TRANSPOSE4_PS(s0, s1, s2, s3); /* s_j now holds lane j of the four sums */
  const __m128 r = _mm_add_ps(_mm_add_ps(s0, s2), _mm_add_ps(s1, s3));
  _mm_storeu_ps(sc, _mm_mul_ps(r, _mm_set1_ps(scale)));
#else
  sc[0] = hsum(a0) * scale;
  sc[1] = hsum(a1) * scale;
  sc[2] = hsum(a2) * scale;
  sc[3] = hsum(a3) * scale;
#endif
}

/* Four keys' dot products at once: each is dot()'s arithmetic (so its bits), but the four
 * accumulation chains run side by side where one key at a time waited on each FMA's latency. */
static void dot4(const float *q, const float *k, int64_t s_pos, int hd, float scale, float *sc) {
  vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
  const float *k1 = k + s_pos, *k2 = k1 + s_pos, *k3 = k2 + s_pos;
  for (int i = 0; i < hd; i += VL) {
    const vf x = ld(q + i);
    a0 += x * ld(k + i);
    a1 += x * ld(k1 + i);
    a2 += x * ld(k2 + i);
    a3 += x * ld(k3 + i);
  }
  hsum4(a0, a1, a2, a3, scale, sc);
}

/* dot4 for two query heads (q, q + hd) sharing the keys: each key vector loaded once serves
 * both (8 chains, 6 loads per 8 FMAs where dot4 makes 5 per 4). sc and sc2: their scores. */
static void dot2x4(const float *q, int hd, const float *k, int64_t s_pos, float scale, float *sc,
                   float *sc2) {
  vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
  const float *k1 = k + s_pos, *k2 = k1 + s_pos, *k3 = k2 + s_pos, *q2 = q + hd;
  for (int i = 0; i < hd; i += VL) {
    const vf x = ld(q + i), y = ld(q2 + i);
    vf kk = ld(k + i);
    a0 += x * kk;
    b0 += y * kk;
    kk = ld(k1 + i);
    a1 += x * kk;
    b1 += y * kk;
    kk = ld(k2 + i);
    a2 += x * kk;
    b2 += y * kk;
    kk = ld(k3 + i);
    a3 += x * kk;
    b3 += y * kk;
  }
  hsum4(a0, a1, a2, a3, scale, sc);
  hsum4(b0, b1, b2, b3, scale, sc2);
}

/* out[d] += sum_j p[j] V[j, d] for j < n, in order for every d, with C vectors of d
 * accumulated side by side over each V row (C independent chains, not one waiting on each
 * FMA). Called chunk after chunk of keys, it makes the bits of a single loop over all j. */
#define PV_CHUNK(C)                                                                      \
  static void pv_##C(const float *p, const float *V, int64_t s_pos, int n, float *out) { \
    vf o[C];                                                                             \
    for (int c = 0; c < C; c++) o[c] = ld(out + c * VL);                                 \
    for (int j = 0; j < n; j++, V += s_pos)                                              \
      for (int c = 0; c < C; c++) o[c] += p[j] * ld(V + c * VL);                          \
    for (int c = 0; c < C; c++) st(out + c * VL, o[c]);                                  \
  }
PV_CHUNK(1)
PV_CHUNK(4)
PV_CHUNK(8)

static void pv(const float *p, const float *V, int64_t s_pos, int n, int hd, float *out) {
  const int c = hd % (8 * VL) == 0 ? 8 : hd % (4 * VL) == 0 ? 4 : 1;
  for (int d = 0; d < hd; d += c * VL) {
    if (c == 8) pv_8(p, V + d, s_pos, n, out + d);
    else if (c == 4) pv_4(p, V + d, s_pos, n, out + d);
    else pv_1(p, V + d, s_pos, n, out + d);
  }
}

/* Keys a chunk: 64 keys of a 64-wide head are 16 KB of K (or V), read from memory once and
 * then from L1 by every query of the chunk. */
#define ATT_CHUNK 64

/* Attention of the R rows of one sequence (one KV row, keys from lo; row r sees keys up to
 * slot[r]) for the G query heads of one KV head. Every query head of every row reads a chunk
 * of keys while it is in L1, where one query at a time over all keys read a verify block's
 * keys from L2/L3 once per row and head. Against that loop (one chain per key, one per output
 * vector), bench/kernel_ab.py at 1,000 cached tokens: verify(5) 69.6 -> 58.6 ms, verify(1)
 * 41.9 -> 37.9, the draft's step 18.2 -> 16.2.
 * q [R, qd] and out [R, qd] point at the group's first head; sc holds R * G * ctx scores.
 * Every score is dot()'s arithmetic and every output sums over keys in order: the bits do not
 * depend on R, G or the chunking. hd % 16 == 0. */
static void attend(const float *q, int qd, const float *K, const float *V, int64_t s_pos, int lo,
                   const int32_t *slot, int R, int G, int hd, float scale, float *sc, int ctx,
                   float *out) {
  K += (int64_t)lo * s_pos; /* from here on, keys count from the window's start */
  V += (int64_t)lo * s_pos;
  int seen[R], n = 1; /* the keys each row sees; the most any row does */
  for (int r = 0; r < R; r++) {
    seen[r] = slot[r] - lo + 1;
    if (seen[r] > n) n = seen[r];
  }
  for (int j0 = 0; j0 < n; j0 += ATT_CHUNK) {
    const int j1 = j0 + ATT_CHUNK < n ? j0 + ATT_CHUNK : n;
    for (int r = 0; r < R; r++) {
      const int e = j1 < seen[r] ? j1 : seen[r];
      int g = 0;
      for (; g + 2 <= G; g += 2) {
        const float *qq = q + (size_t)r * qd + g * hd;
        float *s = sc + (size_t)(r * G + g) * ctx, *s2 = s + ctx;
        int j = j0;
        for (; j + 4 <= e; j += 4)
          dot2x4(qq, hd, K + (int64_t)j * s_pos, s_pos, scale, s + j, s2 + j);
        for (; j < e; j++) {
          s[j] = dot(qq, K + (int64_t)j * s_pos, hd) * scale;
          s2[j] = dot(qq + hd, K + (int64_t)j * s_pos, hd) * scale;
        }
      }
      for (; g < G; g++) {
        const float *qq = q + (size_t)r * qd + g * hd;
        float *s = sc + (size_t)(r * G + g) * ctx;
        int j = j0;
        for (; j + 4 <= e; j += 4) dot4(qq, K + (int64_t)j * s_pos, s_pos, hd, scale, s + j);
        for (; j < e; j++) s[j] = dot(qq, K + (int64_t)j * s_pos, hd) * scale;
      }
    }
  }
  float inv[R * G];
  for (int r = 0; r < R; r++)
    for (int g = 0; g < G; g++) {
      float *s = sc + (size_t)(r * G + g) * ctx;
      float mx = -INFINITY;
      for (int j = 0; j < seen[r]; j++)
        if (s[j] > mx) mx = s[j];
      inv[r * G + g] = 1.0f / exp_shifted_sum(s, seen[r], mx);
      memset(out + (size_t)r * qd + g * hd, 0, hd * sizeof(float));
    }
  for (int j0 = 0; j0 < n; j0 += ATT_CHUNK) {
    const int j1 = j0 + ATT_CHUNK < n ? j0 + ATT_CHUNK : n;
    for (int r = 0; r < R; r++) {
      const int e = j1 < seen[r] ? j1 : seen[r];
      if (e <= j0) continue;
      for (int g = 0; g < G; g++)
        pv(sc + (size_t)(r * G + g) * ctx + j0, V + (int64_t)j0 * s_pos, s_pos, e - j0, hd,
           out + (size_t)r * qd + g * hd);
    }
  }
  for (int r = 0; r < R; r++)
    for (int g = 0; g < G; g++) {
      float *o = out + (size_t)r * qd + g * hd;
      for (int d = 0; d < hd; d++) o[d] *= inv[r * G + g];
    }
}

/* The rows from m on that belong to one sequence (a verify block): same KV row, same window
 * start. A batched decode step's rows are runs of one. */
static int run_of(const int32_t *rseg, const int32_t *rb, const int32_t *rlo, int m, int M) {
  int r = 1;
  while (m + r < M && rb[m + r] == rb[m] && rlo[m + r] == rlo[m] &&
         (!rseg || rseg[m + r] == rseg[m]))
    r++;
  return r;
}

/* Prefill-sized matmuls (more than 16 rows) on weights packed in panels of GN outputs,
 * P[N / GN][K][GN] (``pack_panels`` in _kernels.py): the GN weights of one input are one
 * contiguous run, a 64-byte line on AVX2. A tile of up to GM rows keeps GM x 2 accumulators
 * in registers and takes, per input, two weight vectors and GM broadcasts of X: an outer
 * product, bound by the FMAs, with no lane sums. The first tile of a panel prefetches the
 * next panel into L2, so the weights' DRAM read overlaps the arithmetic (oneDNN's blocked
 * GEMM at 50 rows ran at 63 GFLOP/s from DRAM against 74 from cache here; this kernel 84).
 * Each output sums over k in order, so a row's bits do not depend on M or on the tiling. */
#define GN (2 * VL)
#if VL == 16 /* AVX-512's 32 registers hold 12 x 2 accumulators: on a Xeon (2026-12-06) the
                 * GEMM went 120-132 -> 124-143 GFLOP/s at 50-128 rows, a cache hit's TTFT
                 * 149 -> 141-145 ms and a 1,050-token prefill 2.46 -> 2.35 s */
#define GM 12
#else
#define GM 6
#endif
/* Tiles of 1..GM rows: EACH_TILE(F) defines F(1)..F(GM); SWITCH_TILE(CALL, mr) calls CALL(mr). */
#if GM > 6
#define EACH_TILE(F) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12)
#define SWITCH_TILE(CALL, mr) switch (mr) { \
  case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
  case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break; \
  case 9: CALL(9); break; case 10: CALL(10); break; case 11: CALL(11); break; default: CALL(12); }
#else
#define EACH_TILE(F) F(1) F(2) F(3) F(4) F(5) F(6)
#define SWITCH_TILE(CALL, mr) switch (mr) { \
  case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
  case 5: CALL(5); break; default: CALL(6); }
#endif
#define PANEL_TILE(MR)                                                                     \
  static void ptile_##MR(const float *p, const float *x, int K, float *y, int N,          \
                         const float *pf, int kp, int step) {                               \
    vf c0[MR], c1[MR];                                                                      \
    for (int i = 0; i < MR; i++) c0[i] = c1[i] = (vf){0};                                   \
    for (int k = 0; k < K; k++, p += GN) {                                                  \
      if (k == kp) {                                                                        \
        for (int l = 0; l < GN; l += 16) __builtin_prefetch(pf + (size_t)k * GN + l, 0, 2); \
        kp += step;                                                                         \
      }                                                                                     \
      const vf b0 = ld(p), b1 = ld(p + VL);                                                 \
      for (int i = 0; i < MR; i++) {                                                        \
        const float a = x[(size_t)i * K + k];                                               \
        c0[i] += a * b0;                                                                    \
        c1[i] += a * b1;                                                                    \
      }                                                                                     \
    }                                                                                       \
    for (int i = 0; i < MR; i++) {                                                          \
      st(y + (size_t)i * N, c0[i]);                                                         \
      st(y + (size_t)i * N + VL, c1[i]);                                                    \
    }                                                                                       \
  }
EACH_TILE(PANEL_TILE)

int panel_width(void) { return GN; }

typedef struct {
  const float *P, *X;
  float *Y;
  int M, N, K, p0, p1;
} panels_job;

/* Panels [p0, p1) for all M rows; tiles balanced (50 rows in tiles of 6: 5 x 6 + 4 x 5, not
 * 8 x 6 + 2). The panel two ahead is prefetched while this one runs, its inputs spread over the
 * tiles (tile t takes inputs t, t + tiles, ...): all in the first tile, or one panel ahead, left
 * 50 rows at 86-88 GFLOP/s from DRAM against 98-101 from cache. */
static void *panels_run(void *arg) {
  const panels_job *j = arg;
  const int K = j->K, N = j->N, tiles = (j->M + GM - 1) / GM;
  for (int pn = j->p0; pn < j->p1; pn++) {
    const float *p = j->P + (size_t)pn * K * GN;
    const float *pf = pn + 2 < j->p1 ? p + (size_t)2 * K * GN : NULL;
    for (int t = 0, m0 = 0; t < tiles; t++) {
      const int mr = (j->M - m0) / (tiles - t), kp = pf ? t : K;
      const float *x = j->X + (size_t)m0 * K;
      float *y = j->Y + (size_t)m0 * N + (size_t)pn * GN;
#define PTILE(n) ptile_##n(p, x, K, y, N, pf, kp, tiles)
      SWITCH_TILE(PTILE, mr)
#undef PTILE
      m0 += mr;
    }
  }
  return NULL;
}

/* Y [M, N] = X [M, K] W^T with W packed as P; N % GN == 0. threads > 1 splits the panels
 * between this thread and threads - 1 others; a share whose thread cannot start runs here. */
void gemm_panels(const float *P, const float *X, float *Y, int M, int N, int K, int threads) {
  const int panels = N / GN;
  if (threads > panels) threads = panels;
  if (threads < 1) threads = 1;
  panels_job jobs[threads];
  pthread_t tid[threads];
  int started[threads];
  for (int t = 0; t < threads; t++)
    jobs[t] = (panels_job){P, X, Y, M, N, K, panels * t / threads, panels * (t + 1) / threads};
  for (int t = 1; t < threads; t++)
    started[t] = pthread_create(&tid[t], NULL, panels_run, &jobs[t]) == 0;
  panels_run(&jobs[0]);
  for (int t = 1; t < threads; t++) {
    if (started[t]) pthread_join(tid[t], NULL);
    else panels_run(&jobs[t]);
  }
}

/* Attention for prefill-sized runs (more than ATT_EXACT_ROWS rows of one sequence): flash
 * style, the R x G query vectors in tiles of GM against chunks of KC keys, the scores and the
 * PV product as outer-product tiles like gemm_panels (no lane sums), the softmax online (a
 * running max and sum per query, the output rescaled when the max grows). attend's 1,000-key
 * score rows and one-query-at-a-time dot products ran a cached prefill's attention at ~49
 * GFLOP/s, as torch's flash kernel did. A query's result depends on the chunking, so a
 * prefill row is float rounding away from attend's (within tolerance, tested), not bitwise.
 * work: hd * KC + GM * KC + 2 * R * G floats. Causal runs skip the chunks no row of a tile
 * sees. hd % (2 * VL) == 0. */
#define KC 64
static inline vf vmax(vf a, vf b) {
  const vfi gt = a > b;
  return (vf)(((vfi)a & gt) | ((vfi)b & ~gt));
}
#define QK_TILE(MR)                                                                            \
  static void qk_##MR(const float *const *qp, const float *kt, int hd, float scale, float *s,  \
                      vf *top) {                                                                \
    vf a0[MR], a1[MR];                                                                          \
    for (int i = 0; i < MR; i++) a0[i] = a1[i] = (vf){0};                                       \
    for (int d = 0; d < hd; d++, kt += KC) {                                                    \
      const vf b0 = ld(kt), b1 = ld(kt + VL);                                                   \
      for (int i = 0; i < MR; i++) {                                                            \
        const float a = qp[i][d];                                                               \
        a0[i] += a * b0;                                                                        \
        a1[i] += a * b1;                                                                        \
      }                                                                                         \
    }                                                                                           \
    for (int i = 0; i < MR; i++) {                                                              \
      a0[i] *= scale;                                                                           \
      a1[i] *= scale;                                                                           \
      st(s + i * KC, a0[i]);                                                                    \
      st(s + i * KC + VL, a1[i]);                                                               \
      top[i] = vmax(top[i], vmax(a0[i], a1[i]));                                                \
    }                                                                                           \
  }
#define PV_TILE(MR)                                                                             \
  static void pvt_##MR(float *const *op, const float *p, const float *V, int64_t s_pos, int nk, \
                       int d0) {                                                                \
    vf o0[MR], o1[MR];                                                                          \
    for (int i = 0; i < MR; i++) {                                                              \
      o0[i] = ld(op[i] + d0);                                                                   \
      o1[i] = ld(op[i] + d0 + VL);                                                              \
    }                                                                                           \
    for (int j = 0; j < nk; j++, V += s_pos) {                                                  \
      const vf b0 = ld(V + d0), b1 = ld(V + d0 + VL);                                           \
      for (int i = 0; i < MR; i++) {                                                            \
        const float a = p[i * KC + j];                                                          \
        o0[i] += a * b0;                                                                        \
        o1[i] += a * b1;                                                                        \
      }                                                                                         \
    }                                                                                           \
    for (int i = 0; i < MR; i++) {                                                              \
      st(op[i] + d0, o0[i]);                                                                    \
      st(op[i] + d0 + VL, o1[i]);                                                               \
    }                                                                                           \
  }
EACH_TILE(QK_TILE)
EACH_TILE(PV_TILE)

static void qk_tile(int mr, const float *const *qp, const float *kt, int hd, float scale,
                    float *s, vf *top) {
#define QK(n) qk_##n(qp, kt, hd, scale, s, top)
  SWITCH_TILE(QK, mr)
#undef QK
}

static void pv_tile(int mr, float *const *op, const float *p, const float *V, int64_t s_pos,
                    int nk, int d0) {
#define PVT(n) pvt_##n(op, p, V, s_pos, nk, d0)
  SWITCH_TILE(PVT, mr)
#undef PVT
}

/* One tile's scores for keys [j0, j0 + nk) -> probabilities in place, the running max and sum
 * updated and the outputs rescaled where the max grew. Row i sees seen[i] keys in all. top[i]:
 * the lanes' max of row i's scores as qk_tile stored them (all nk columns and no more when nk
 * is a multiple of 2 * VL): a row that sees all of them takes its max from there. */
static void online_softmax(float *S, int mr, int nk, int j0, const int *seen, const vf *top,
                           float *mx, float *l, float *const *op, int hd) {
  for (int i = 0; i < mr; i++) {
    float *s = S + i * KC;
    int own = seen[i] - j0;
    if (own > nk) own = nk;
    if (own <= 0) { /* a row that sees none of these keys: they weigh nothing */
      memset(s, 0, nk * sizeof(float));
      continue;
    }
    float m = mx[i];
    if (own == nk && nk % (2 * VL) == 0) {
      for (int t = 0; t < VL; t++)
        if (top[i][t] > m) m = top[i][t];
    } else {
      for (int j = 0; j < own; j++)
        if (s[j] > m) m = s[j];
    }
    /* 0 on the first chunk (mx = -inf); 1, with nothing to rescale, while the max holds */
    const float alpha = m > mx[i] ? expf(mx[i] - m) : 1.0f;
    const float sum = exp_shifted_sum(s, own, m);
    if (own < nk) memset(s + own, 0, (nk - own) * sizeof(float));
    l[i] = l[i] * alpha + sum;
    mx[i] = m;
    if (alpha != 1.0f)
      for (int d = 0; d < hd; d++) op[i][d] *= alpha;
  }
}

static void attend_tiles(const float *q, int qd, const float *K, const float *V, int64_t s_pos,
                         int lo, const int32_t *slot, int R, int G, int hd, float scale,
                         float *work, float *out) {
  K += (int64_t)lo * s_pos;
  V += (int64_t)lo * s_pos;
  const int nq = R * G;
  float *kt = work, *S = kt + hd * KC, *mx = S + GM * KC, *l = mx + nq;
  int n = 1;
  for (int r = 0; r < R; r++)
    if (slot[r] - lo + 1 > n) n = slot[r] - lo + 1;
  for (int v = 0; v < nq; v++) {
    mx[v] = -INFINITY;
    l[v] = 0;
    memset(out + (size_t)(v / G) * qd + (v % G) * hd, 0, hd * sizeof(float));
  }
  for (int j0 = 0; j0 < n; j0 += KC) {
    const int nkc = n - j0 < KC ? n - j0 : KC;
    /* the chunk's keys transposed, zeros past its end; read row by row (column by column
     * was ~10 % of this function, each key's first line a cache miss per column) */
    for (int c = 0; c < KC; c++) {
      const float *k = K + (int64_t)(j0 + c) * s_pos;
      if (c < nkc)
        for (int d = 0; d < hd; d++) kt[d * KC + c] = k[d];
      else
        for (int d = 0; d < hd; d++) kt[d * KC + c] = 0;
    }
    for (int v0 = 0; v0 < nq; v0 += GM) {
      const int mr = nq - v0 < GM ? nq - v0 : GM;
      const float *qp[GM];
      float *op[GM];
      int seen[GM], most = 0;
      for (int i = 0; i < mr; i++) {
        const int r = (v0 + i) / G, g = (v0 + i) % G;
        qp[i] = q + (size_t)r * qd + g * hd;
        op[i] = out + (size_t)r * qd + g * hd;
        seen[i] = slot[r] - lo + 1;
        if (seen[i] > most) most = seen[i];
      }
      if (most <= j0) continue;
      const int nk = most - j0 < nkc ? most - j0 : nkc;
      vf top[GM];
      for (int i = 0; i < mr; i++) top[i] = (vf){0} - INFINITY;
      for (int c = 0; c < nk; c += 2 * VL) qk_tile(mr, qp, kt + c, hd, scale, S + c, top);
      online_softmax(S, mr, nk, j0, seen, top, mx + v0, l + v0, op, hd);
      for (int d0 = 0; d0 < hd; d0 += 2 * VL)
        pv_tile(mr, op, S, V + (int64_t)j0 * s_pos, s_pos, nk, d0);
    }
  }
  for (int v = 0; v < nq; v++) {
    float *o = out + (size_t)(v / G) * qd + (v % G) * hd;
    const float inv = 1.0f / l[v];
    for (int d = 0; d < hd; d++) o[d] *= inv;
  }
}

/* A cache hit's prefix KV, copied into the slab layer by layer on a thread of its own while
 * the layers before compute (a radix span [layers, 2, kv_heads, n, hd] with its strides in
 * floats, to slab row `row` from position `pos`): 1,000 cached tokens are 46 MB, ~5 ms of
 * copying that a cache hit's first token waited for. */
typedef struct {
  const float *src;
  int64_t s_layer, s_kv, s_head, s_pos;
  int32_t n, row, pos, pad;
} kv_copy_t;

typedef struct {
  const kv_copy_t *c;
  int nc, L, nkv, hd;
  float *kv;
  int64_t s_layer, s_kv, s_b, s_head, s_pos;
  int done; /* layers copied, read and written atomically */
} copier_t;

static void *copier_run(void *arg) {
  copier_t *cp = arg;
  const size_t row_bytes = (size_t)cp->hd * sizeof(float);
  for (int l = 0; l < cp->L; l++) {
    for (int i = 0; i < cp->nc; i++) {
      const kv_copy_t *c = cp->c + i;
      for (int t = 0; t < 2; t++)
        for (int h = 0; h < cp->nkv; h++) {
          const float *src = c->src + l * c->s_layer + t * c->s_kv + h * c->s_head;
          float *dst = cp->kv + l * cp->s_layer + t * cp->s_kv + c->row * cp->s_b +
                       h * cp->s_head + (int64_t)c->pos * cp->s_pos;
          if (c->s_pos == cp->hd && cp->s_pos == cp->hd)
            memcpy(dst, src, (size_t)c->n * row_bytes);
          else
            for (int p = 0; p < c->n; p++)
              memcpy(dst + p * cp->s_pos, src + p * c->s_pos, row_bytes);
        }
    }
    __atomic_store_n(&cp->done, l + 1, __ATOMIC_RELEASE);
  }
  return NULL;
}

static void copier_wait(copier_t *cp, int layers) {
  while (__atomic_load_n(&cp->done, __ATOMIC_ACQUIRE) < layers) sched_yield();
}

/* One KV buffer (a slab) and its element strides: per layer, key/value, batch row, KV head,
 * slot; head_dim contiguous. */
typedef struct {
  float *kv;
  int64_t s_layer, s_kv, s_b, s_head, s_pos;
} kv_seg_t;

/* x [M, H]: the residual stream in, the last layer's output out (before the final norm).
 * lins: 7 per layer (q, k, v, o, gate, up, down); norms: 2 per layer (input, post-attention).
 * cs, sn: rotary cos/sin [M, hd]. Row m's KV lives in segs[rseg[m]] (rseg NULL: segs[0]);
 * copies (the deferred prefix spans) go to segs[0]. threads: for the panel GEMMs of more than
 * EXACT_ROWS rows. Returns 0, or -1 when out of memory (x is then undefined). */
static int layers_run(const lin_t *lins, const float *const *norms, int L, int H, int nh,
                      int nkv, int hd, int F, float eps, float scale, float *x, int M,
                      const float *cs, const float *sn, const kv_seg_t *segs,
                      const int32_t *rseg, const int32_t *rb, const int32_t *rslot,
                      const int32_t *rlo, const kv_copy_t *copies, int ncopies, int threads) {
  const int qd = nh * hd, kd = nkv * hd, group = nh / nkv;
  int ctx = 1, runs = 1, tiled = 0; /* the longest run attend takes; attend_tiles' */
  for (int m = 0; m < M; m++)
    if (rslot[m] - rlo[m] + 1 > ctx) ctx = rslot[m] - rlo[m] + 1;
  const int tiles_fit = hd % (2 * VL) == 0; /* attend_tiles' output blocks (else attend) */
  for (int m = 0, r; m < M; m += r) {
    r = run_of(rseg, rb, rlo, m, M);
    if (tiles_fit && r > EXACT_ROWS && r > tiled) tiled = r;
    else if ((!tiles_fit || r <= EXACT_ROWS) && r > runs) runs = r;
  }
  size_t work = (size_t)runs * group * ctx, work_tiles = (size_t)hd * KC + GM * KC;
  work_tiles += 2 * (size_t)tiled * group;
  if (tiled && work_tiles > work) work = work_tiles;
  const size_t n = (size_t)M * (H + 2 * qd + 2 * kd + 2 * F) + work;
  /* the prefix copy starts first: on its own thread, else here, all of it, before anything */
  const kv_seg_t *s0 = segs;
  copier_t cp = {copies, ncopies, L, nkv, hd, s0->kv, s0->s_layer, s0->s_kv, s0->s_b,
                 s0->s_head, s0->s_pos, 0};
  pthread_t copier;
  const int threaded = ncopies > 0 && pthread_create(&copier, NULL, copier_run, &cp) == 0;
  if (ncopies > 0 && !threaded) copier_run(&cp);
  float *buf = malloc(n * sizeof(float));
  if (!buf) {
    if (threaded) pthread_join(copier, NULL);
    return -1;
  }
  float *h = buf, *q = h + (size_t)M * H, *k = q + (size_t)M * qd, *v = k + (size_t)M * kd;
  float *att = v + (size_t)M * kd, *g = att + (size_t)M * qd, *u = g + (size_t)M * F;
  float *sc = u + (size_t)M * F;
  for (int l = 0; l < L; l++) {
    const lin_t *W = lins + 7 * l;
    for (int m = 0; m < M; m++) rmsnorm(x + (size_t)m * H, norms[2 * l], h + (size_t)m * H, H, eps);
    if (lin_apply(W + 0, h, q, M, threads)) goto fail;
    if (lin_apply(W + 1, h, k, M, threads)) goto fail;
    if (lin_apply(W + 2, h, v, M, threads)) goto fail;
    for (int m = 0; m < M; m++) {
      const kv_seg_t *sg = segs + (rseg ? rseg[m] : 0);
      float *KV = sg->kv + (int64_t)l * sg->s_layer;
      rope(q + (size_t)m * qd, nh, hd, cs + (size_t)m * hd, sn + (size_t)m * hd);
      rope(k + (size_t)m * kd, nkv, hd, cs + (size_t)m * hd, sn + (size_t)m * hd);
      for (int j = 0; j < nkv; j++) {
        float *dst = KV + rb[m] * sg->s_b + j * sg->s_head + (int64_t)rslot[m] * sg->s_pos;
        memcpy(dst, k + (size_t)m * kd + j * hd, hd * sizeof(float));
        memcpy(dst + sg->s_kv, v + (size_t)m * kd + j * hd, hd * sizeof(float));
      }
    }
    if (ncopies > 0) copier_wait(&cp, l + 1); /* this layer's prefix is in */
    /* each run of rows of one sequence: one pass over its keys for them all */
    for (int m = 0, r; m < M; m += r) {
      r = run_of(rseg, rb, rlo, m, M);
      const kv_seg_t *sg = segs + (rseg ? rseg[m] : 0);
      const float *KV = sg->kv + (int64_t)l * sg->s_layer;
      const int64_t s_pos = sg->s_pos;
      for (int j = 0; j < nkv; j++) {
        const float *K = KV + rb[m] * sg->s_b + j * sg->s_head;
        const float *qj = q + (size_t)m * qd + j * group * hd;
        float *oj = att + (size_t)m * qd + j * group * hd;
        if (tiles_fit && r > EXACT_ROWS)
          attend_tiles(qj, qd, K, K + sg->s_kv, s_pos, rlo[m], rslot + m, r, group, hd, scale,
                       sc, oj);
        else
          attend(qj, qd, K, K + sg->s_kv, s_pos, rlo[m], rslot + m, r, group, hd, scale, sc,
                 ctx, oj);
      }
    }
    if (lin_apply(W + 3, att, h, M, threads)) goto fail;
    for (size_t i = 0; i < (size_t)M * H; i++) x[i] += h[i];
    for (int m = 0; m < M; m++)
      rmsnorm(x + (size_t)m * H, norms[2 * l + 1], h + (size_t)m * H, H, eps);
    if (lin_apply(W + 4, h, g, M, threads)) goto fail;
    if (lin_apply(W + 5, h, u, M, threads)) goto fail;
    silu_mul(g, u, (size_t)M * F);
    if (lin_apply(W + 6, g, h, M, threads)) goto fail;
    for (size_t i = 0; i < (size_t)M * H; i++) x[i] += h[i];
  }
  free(buf);
  if (threaded) pthread_join(copier, NULL);
  return 0;
fail:
  free(buf);
  if (threaded) pthread_join(copier, NULL); /* it copies every layer: the slab stays whole */
  return -1;
}

/* One KV buffer for all rows (a decode batch, a verify block, a prefill), one thread. */
int llama_layers(const lin_t *lins, const float *const *norms, int L, int H, int nh, int nkv,
                 int hd, int F, float eps, float scale, float *x, int M, const float *cs,
                 const float *sn, float *kv, int64_t s_layer, int64_t s_kv, int64_t s_b,
                 int64_t s_head, int64_t s_pos, const int32_t *rb, const int32_t *rslot,
                 const int32_t *rlo, const kv_copy_t *copies, int ncopies) {
  const kv_seg_t seg = {kv, s_layer, s_kv, s_b, s_head, s_pos};
  return layers_run(lins, norms, L, H, nh, nkv, hd, F, eps, scale, x, M, cs, sn, &seg, NULL, rb,
                    rslot, rlo, copies, ncopies, 1);
}

/* Many sequences' rows in one pass, each sequence's KV in a buffer of its own (segs[rseg[m]]):
 * the batched verify of many sessions, every linear one GEMM over all rows (the panels past
 * EXACT_ROWS rows, on `threads` threads), attention per sequence over its own slab. */
int llama_layers_multi(const lin_t *lins, const float *const *norms, int L, int H, int nh,
                       int nkv, int hd, int F, float eps, float scale, float *x, int M,
                       const float *cs, const float *sn, const kv_seg_t *segs,
                       const int32_t *rseg, const int32_t *rb, const int32_t *rslot,
                       const int32_t *rlo, int threads) {
  return layers_run(lins, norms, L, H, nh, nkv, hd, F, eps, scale, x, M, cs, sn, segs, rseg, rb,
                    rslot, rlo, NULL, 0, threads);
}
