// The CPU attention kernel's inner loops on fp32 tiles: logits of 4 query
// rows against a chunk of tokens, a row's exponentials and their sum, and the
// probabilities times the chunk's values. Plain loops shaped for the compiler's vectoriser (fixed
// tile sizes, accumulators that stay in registers); on x86-64 with GCC and
// glibc each is also compiled for AVX2+FMA and AVX-512 and the widest the
// CPU supports is picked once at load time (function multi-versioning), so
// that a build for the baseline x86-64 still runs at the machine's vector
// width. Only these float-only leaf functions are cloned: nothing they call
// is compiled for an ISA the CPU may lack.
#pragma once

#include <cstddef>  // defines __GLIBC__ where the C library is glibc
#include <cstdint>
#include <cstring>

namespace jax_paged {
namespace cpu {

// Tokens per chunk of the online softmax (K and V of a chunk are converted to
// fp32 once and shared by every row of the work item), a multiple of every
// block size (8, 16, 32) and of kTokTile.
constexpr int kChunk = 64;
// Query rows per tile and tokens / dims per inner tile: 4 x 16 fp32
// accumulators (4 AVX-512 or 8 AVX2 registers).
constexpr int kRowTile = 4;
constexpr int kTokTile = 16;
constexpr int kDimTile = 16;

// Clones need GCC >= 11 (the x86-64-v3 / -v4 names) and glibc's ifunc
// resolution; JAX_PAGED_CPU_NO_CLONES builds the baseline only.
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) && \
    __GNUC__ >= 11 && !defined(JAX_PAGED_CPU_NO_CLONES)
#define JAX_PAGED_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAX_PAGED_CPU_CLONES
#endif
// Inlined into each clone (compiled for the clone's instruction set).
#if defined(__GNUC__) || defined(__clang__)
#define JAX_PAGED_CPU_INLINE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define JAX_PAGED_CPU_INLINE __forceinline
#else
#define JAX_PAGED_CPU_INLINE inline
#endif

// s[r][t] = sum_{d < dims} q[r][d] * kd[d][t] for r < kRowTile, t in [t0, t1)
// (multiples of kTokTile, at most kChunk). q: [kRowTile][q_stride], kd:
// [dims][kChunk] (the chunk's keys, dim-major), s: [kRowTile][kChunk].
JAX_PAGED_CPU_CLONES
static void LogitsTile(const float* __restrict q, int q_stride, const float* __restrict kd,
                       int dims, int t0, int t1, float* __restrict s) {
  for (int tb = t0; tb < t1; tb += kTokTile) {
    float a0[kTokTile] = {}, a1[kTokTile] = {}, a2[kTokTile] = {}, a3[kTokTile] = {};
    for (int d = 0; d < dims; ++d) {
      const float* k = kd + d * kChunk + tb;
      const float q0 = q[d], q1 = q[q_stride + d], q2 = q[2 * q_stride + d],
                  q3 = q[3 * q_stride + d];
      for (int i = 0; i < kTokTile; ++i) {
        a0[i] += q0 * k[i];
        a1[i] += q1 * k[i];
        a2[i] += q2 * k[i];
        a3[i] += q3 * k[i];
      }
    }
    for (int i = 0; i < kTokTile; ++i) {
      s[tb + i] = a0[i];
      s[kChunk + tb + i] = a1[i];
      s[2 * kChunk + tb + i] = a2[i];
      s[3 * kChunk + tb + i] = a3[i];
    }
  }
}

// acc[r][d] += sum_{t in [t0, t1)} p[r][t] * vt[t][d] for r < kRowTile, d <
// dims (a multiple of kDimTile). p: [kRowTile][kChunk], vt: [kChunk][stride]
// (the chunk's values, token-major), acc: [kRowTile][stride].
JAX_PAGED_CPU_CLONES
static void ValuesTile(const float* __restrict p, const float* __restrict vt, int stride,
                       int dims, int t0, int t1, float* __restrict acc) {
  for (int db = 0; db < dims; db += kDimTile) {
    float a0[kDimTile], a1[kDimTile], a2[kDimTile], a3[kDimTile];
    for (int i = 0; i < kDimTile; ++i) {
      a0[i] = acc[db + i];
      a1[i] = acc[stride + db + i];
      a2[i] = acc[2 * stride + db + i];
      a3[i] = acc[3 * stride + db + i];
    }
    for (int t = t0; t < t1; ++t) {
      const float* v = vt + t * stride + db;
      const float p0 = p[t], p1 = p[kChunk + t], p2 = p[2 * kChunk + t], p3 = p[3 * kChunk + t];
      for (int i = 0; i < kDimTile; ++i) {
        a0[i] += p0 * v[i];
        a1[i] += p1 * v[i];
        a2[i] += p2 * v[i];
        a3[i] += p3 * v[i];
      }
    }
    for (int i = 0; i < kDimTile; ++i) {
      acc[db + i] = a0[i];
      acc[stride + db + i] = a1[i];
      acc[2 * stride + db + i] = a2[i];
      acc[3 * stride + db + i] = a3[i];
    }
  }
}

// LogitsTile and ValuesTile for one row (a tile of one query row: MHA
// decode), so that it does not pay for three padding rows. One row has one
// accumulator chain per vector, so these keep a whole chunk's tokens (64) or
// 64 dims in flight to hide the multiply-add latency. (A row-count template
// parameter on the 4-row functions, with [kRows][16] accumulator arrays,
// compiled to loops that kept them in memory: q_len 16, 32/8 heads, 94 -> 815
// ms in the C++ harness.)
JAX_PAGED_CPU_CLONES
static void LogitsRow(const float* __restrict q, const float* __restrict kd, int dims, int t0,
                      int t1, float* __restrict s) {
  float a[kChunk] = {};
  for (int d = 0; d < dims; ++d) {
    const float* k = kd + d * kChunk;
    const float qd = q[d];
    for (int i = 0; i < kChunk; ++i) a[i] += qd * k[i];
  }
  for (int i = t0; i < t1; ++i) s[i] = a[i];
}

// acc[db + i] += sum_{t in [t0, t1)} p[t] * vt[t][db + i] for i < kWidth: one
// row's accumulators for kWidth dims, held in registers over the tokens.
template <int kWidth>
static JAX_PAGED_CPU_INLINE void ValuesRowDims(const float* __restrict p, const float* __restrict vt,
                                               int stride, int db, int t0, int t1,
                                               float* __restrict acc) {
  float a[kWidth];
  for (int i = 0; i < kWidth; ++i) a[i] = acc[db + i];
  for (int t = t0; t < t1; ++t) {
    const float* v = vt + t * stride + db;
    const float pt = p[t];
    for (int i = 0; i < kWidth; ++i) a[i] += pt * v[i];
  }
  for (int i = 0; i < kWidth; ++i) acc[db + i] = a[i];
}

JAX_PAGED_CPU_CLONES
static void ValuesRow(const float* __restrict p, const float* __restrict vt, int stride, int dims,
                      int t0, int t1, float* __restrict acc) {
  constexpr int kWide = 4 * kDimTile;
  int db = 0;
  for (; db + kWide <= dims; db += kWide) ValuesRowDims<kWide>(p, vt, stride, db, t0, t1, acc);
  for (; db < dims; db += kDimTile) ValuesRowDims<kDimTile>(p, vt, stride, db, t0, t1, acc);
}

// exp(x) for x <= 0 (a logit minus its row's maximum), 0 below -87.33 (where
// it would be subnormal; -inf gives 0), NaN for NaN: Cody-Waite reduction x =
// n ln2 + r, |r| <= ln2 / 2, and a degree-7 polynomial for e^r (Cephes'
// expf coefficients), about 1 ulp. Branch-free, so loops over it vectorise
// (the C library's expf is a call per element).
static JAX_PAGED_CPU_INLINE float ExpNonPositive(float x) {
  const float fx = x * 1.44269504088896341f;  // x / ln 2
  const float t = fx + 12582912.0f;             // 1.5 * 2^23: rounds fx to an integer n
  const float n = t - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln2, in two parts
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &t, 4);  // n in the low mantissa bits of t
  bits = (bits << 23) + (127u << 23);  // 2^n, n in [-126, 0]
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return x < -87.33654f ? 0.0f : y * two_n;
}

// p[t] = exp(p[t] - m) for t in [t0, t1) (p[t] <= m, or -inf for a masked
// token, which gives 0); returns the sum of the new p[t]. Summed in 16
// interleaved partial sums (vector lanes), then those in order.
JAX_PAGED_CPU_CLONES
static float ExpShiftedSum(float* __restrict p, int t0, int t1, float m) {
  float part[16] = {};
  int t = t0;
  for (; t + 16 <= t1; t += 16)
    for (int i = 0; i < 16; ++i) {
      const float e = ExpNonPositive(p[t + i] - m);
      p[t + i] = e;
      part[i] += e;
    }
  for (int i = 0; t < t1; ++t, ++i) {
    const float e = ExpNonPositive(p[t] - m);
    p[t] = e;
    part[i] += e;
  }
  float sum = 0.0f;
  for (int i = 0; i < 16; ++i) sum += part[i];
  return sum;
}

}  // namespace cpu
}  // namespace jax_paged
