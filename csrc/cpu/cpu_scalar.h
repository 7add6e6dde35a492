// Storage types and float conversions for the CPU kernels (no XLA, no
// compiler-specific half types, so any C++17 compiler builds it).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "params.h"

namespace jax_paged {
namespace cpu {

struct f16_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

inline uint32_t FloatBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float BitsFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float ToFloat(float v) { return v; }
inline float ToFloat(bf16_t v) { return BitsFloat(uint32_t{v.bits} << 16); }
inline float ToFloat(f16_t v) {
  const uint32_t h = v.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsFloat(FloatBits(mag) | sign);
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // inf / nan
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

// Round-to-nearest-even conversions, as the CUDA intrinsics do.
template <typename T> T FromFloat(float f);
template <> inline float FromFloat<float>(float f) { return f; }
template <> inline bf16_t FromFloat<bf16_t>(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((x >> 16) | 0x40u)};
  return bf16_t{static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}
template <> inline f16_t FromFloat<f16_t>(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return f16_t{static_cast<uint16_t>(sign | (absx > 0x7f800000u ? 0x7e00u : 0x7c00u))};
  if (absx >= 0x477ff000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520: inf
  if (absx < 0x38800000u) {  // below the smallest normal half: subnormal
    const float scaled = BitsFloat(absx) * 16777216.0f;  // exact power-of-two scaling
    return f16_t{static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)))};
  }
  uint32_t m = absx + 0xC8000000u;  // rebias exponent from 127 to 15
  m += 0xfffu + ((m >> 13) & 1u);
  return f16_t{static_cast<uint16_t>(sign | (m >> 13))};
}

// ---- fp8 (KV caches only) ----------------------------------------------------
struct fp8e4m3_t { uint8_t bits; };  // float8_e4m3fn: bias 7, no inf, max 448
struct fp8e5m2_t { uint8_t bits; };  // float8_e5m2: bias 15, IEEE-like, max 57344

template <int EXP, int MAN, bool FN>
struct Fp8Format {
  static constexpr int kBias = (1 << (EXP - 1)) - 1;
  static constexpr float kMax = FN ? 448.0f : 57344.0f;
  static constexpr uint8_t kMaxCode = FN ? 0x7E : 0x7B;
  static constexpr uint8_t kNaNCode = FN ? 0x7F : 0x7E;

  // 2^e, exactly, at compile time (std::ldexp is not constexpr in C++17).
  static constexpr float PowerOfTwo(int e) {
    float r = 1.0f;
    for (; e > 0; --e) r *= 2.0f;
    for (; e < 0; ++e) r *= 0.5f;
    return r;
  }
  static constexpr float Decode(uint8_t b) {
    const bool neg = (b & 0x80u) != 0;
    const int e = (b >> MAN) & ((1 << EXP) - 1);
    const int m = b & ((1 << MAN) - 1);
    float mag = 0.0f;
    if (FN && e == (1 << EXP) - 1 && m == (1 << MAN) - 1) {
      mag = std::numeric_limits<float>::quiet_NaN();
    } else if (!FN && e == (1 << EXP) - 1) {
      mag = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    } else if (e == 0) {
      mag = static_cast<float>(m) * PowerOfTwo(1 - kBias - MAN);
    } else {
      mag = static_cast<float>((1 << MAN) + m) * PowerOfTwo(e - kBias - MAN);
    }
    return neg ? -mag : mag;
  }

  // Round to nearest even, saturating to +-kMax (infinities included); NaN
  // stays NaN. Equal to clip(f, -max, max) then an exact RNE conversion.
  static uint8_t Encode(float f) {
    const uint8_t sign = std::signbit(f) ? 0x80u : 0u;
    if (std::isnan(f)) return sign | kNaNCode;
    const float a = std::fabs(f);
    if (a >= kMax) return sign | kMaxCode;
    int e;
    std::frexp(a, &e);  // a = frac * 2^e, frac in [0.5, 1)
    int ue = e - 1;     // unbiased exponent of a
    if (ue < 1 - kBias) ue = 1 - kBias;  // subnormal range: fixed quantum
    // a / quantum is exact (power-of-two scaling); nearbyint rounds it to
    // nearest even. code = ((ue + bias - 1) << MAN) + q covers normals,
    // subnormals and the carry into the next binade alike.
    const float q = std::nearbyint(std::ldexp(a, MAN - ue));
    return sign | static_cast<uint8_t>(((ue + kBias - 1) << MAN) + static_cast<int>(q));
  }

  // The decoding table (256 entries), computed at compile time: a lookup has no
  // initialisation guard to test (a function-local static table's guard would be
  // tested at every element of the conversion loops).
  struct Table256 {
    float v[256];
  };
  static constexpr Table256 MakeTable() {
    Table256 t{};
    for (int i = 0; i < 256; ++i) t.v[i] = Decode(static_cast<uint8_t>(i));
    return t;
  }
  static constexpr Table256 kTable = MakeTable();
};
using Fp8E4M3 = Fp8Format<4, 3, true>;
using Fp8E5M2 = Fp8Format<5, 2, false>;
// The tables' ends, checked where they are built: the largest finite value, the
// smallest subnormal, negative zero, and each format's non-finite codes.
static_assert(Fp8E4M3::kTable.v[0x7E] == 448.0f && Fp8E4M3::kTable.v[0xFE] == -448.0f &&
                  Fp8E4M3::kTable.v[0x01] == 0.001953125f && Fp8E4M3::kTable.v[0x08] == 0.015625f &&
                  Fp8E4M3::kTable.v[0x80] == 0.0f && Fp8E4M3::kTable.v[0x7F] != Fp8E4M3::kTable.v[0x7F],
              "e4m3 table");
static_assert(Fp8E5M2::kTable.v[0x7B] == 57344.0f && Fp8E5M2::kTable.v[0x01] == 1.52587890625e-05f &&
                  Fp8E5M2::kTable.v[0x7C] == std::numeric_limits<float>::infinity() &&
                  Fp8E5M2::kTable.v[0xFC] == -std::numeric_limits<float>::infinity() &&
                  Fp8E5M2::kTable.v[0x7E] != Fp8E5M2::kTable.v[0x7E],
              "e5m2 table");

inline float ToFloat(fp8e4m3_t v) { return Fp8E4M3::kTable.v[v.bits]; }
inline float ToFloat(fp8e5m2_t v) { return Fp8E5M2::kTable.v[v.bits]; }
template <> inline fp8e4m3_t FromFloat<fp8e4m3_t>(float f) { return fp8e4m3_t{Fp8E4M3::Encode(f)}; }
template <> inline fp8e5m2_t FromFloat<fp8e5m2_t>(float f) { return fp8e5m2_t{Fp8E5M2::Encode(f)}; }

template <typename T> constexpr bool kIsFp8 = false;
template <> constexpr bool kIsFp8<fp8e4m3_t> = true;
template <> constexpr bool kIsFp8<fp8e5m2_t> = true;

template <ScalarKind K> struct CpuScalar;
template <> struct CpuScalar<ScalarKind::kF32> { using type = float; };
template <> struct CpuScalar<ScalarKind::kF16> { using type = f16_t; };
template <> struct CpuScalar<ScalarKind::kBF16> { using type = bf16_t; };

// Cache storage type for a CacheKind, given the query's storage type T.
template <CacheKind K, typename T> struct CpuCache;
template <typename T> struct CpuCache<CacheKind::kSameAsQuery, T> { using type = T; };
template <typename T> struct CpuCache<CacheKind::kFp8E4M3, T> { using type = fp8e4m3_t; };
template <typename T> struct CpuCache<CacheKind::kFp8E5M2, T> { using type = fp8e5m2_t; };

}  // namespace cpu
}  // namespace jax_paged
