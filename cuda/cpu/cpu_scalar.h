// Storage types and float conversions for the CPU kernels (no XLA, no
// compiler-specific half types, so any C++17 compiler builds it).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../kernels/params.h"

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

template <ScalarKind K> struct CpuScalar;
template <> struct CpuScalar<ScalarKind::kF32> { using type = float; };
template <> struct CpuScalar<ScalarKind::kF16> { using type = f16_t; };
template <> struct CpuScalar<ScalarKind::kBF16> { using type = bf16_t; };

}  // namespace cpu
}  // namespace jax_paged
