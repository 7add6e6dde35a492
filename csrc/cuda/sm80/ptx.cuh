// PTX wrappers of the portable grouped kernel (sm_80 and newer: Ampere, Ada,
// Hopper): asynchronous global -> shared copies (cp.async), ldmatrix,
// mma.sync m16n8k16 / m16n8k8 with fp32 accumulators, and the register
// conversions its products need; the Hopper form uses its ldmatrix and mma.sync
// wrappers too. No Hopper-only instruction appears here.
// Framework-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

// Device code of this directory needs cp.async, ldmatrix and bf16 mma.sync
// (compute capability 8.0); older targets compile a trap.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define JAX_PAGED_SM80_DEVICE 1
#else
#define JAX_PAGED_SM80_DEVICE 0
#endif

namespace jax_paged {
namespace cuda {
namespace sm80 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t SmemAddr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

#if JAX_PAGED_SM80_DEVICE
// ---- asynchronous copies ------------------------------------------------------
// 16 bytes global -> shared, bypassing L1 (streamed once): both ends 16-byte aligned.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// 8 bytes (the rows of 8-token fp8 value pages): both ends 8-byte aligned.
__device__ __forceinline__ void CpAsync8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---- ldmatrix and mma.sync --------------------------------------------------------
__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldsm2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// c += a * b, m16n8k16, A row-major, B column-major, TM = __half or __nv_bfloat16.
template <typename TM>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<TM, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// c += a * b, m16n8k8: the last 8 dims of head sizes that are 8 mod 16.
template <typename TM>
__device__ __forceinline__ void Mma1688(float (&c)[4], const uint32_t (&a)[2], uint32_t b0) {
  if constexpr (std::is_same_v<TM, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b0));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b0));
  }
}
#endif  // JAX_PAGED_SM80_DEVICE

// ---- register conversions -----------------------------------------------------------
// Two floats rounded to TM and packed (lo in the low half).
template <typename TM>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  if constexpr (std::is_same_v<TM, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Four fp8 bytes widened to two f16 pairs, exactly (every e4m3 / e5m2 value is
// an f16 value): lo = bytes 0, 1 and hi = bytes 2, 3, the lower byte in the low
// half. e5m2 is the upper byte of an f16; e4m3 goes through the conversion
// intrinsic (one instruction on sm_89+, a short integer sequence before).
template <typename TC>
__device__ __forceinline__ void Fp8x4ToHalf2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  if constexpr (std::is_same_v<TC, __nv_fp8_e5m2>) {
    lo = __byte_perm(four, 0u, 0x1404u);
    hi = __byte_perm(four, 0u, 0x3424u);
  } else {
    const __half2_raw l = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(four & 0xFFFFu), __NV_E4M3);
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(four >> 16), __NV_E4M3);
    lo = static_cast<uint32_t>(l.x) | (static_cast<uint32_t>(l.y) << 16);
    hi = static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  }
}

// 0xFF in byte i iff bit i of `bits` is set: zeroes the fp8 values of masked tokens.
__device__ __forceinline__ uint32_t ByteMask(uint32_t bits) {
  return ((bits & 1u) ? 0x000000FFu : 0u) | ((bits & 2u) ? 0x0000FF00u : 0u) |
         ((bits & 4u) ? 0x00FF0000u : 0u) | ((bits & 8u) ? 0xFF000000u : 0u);
}
// 0xFFFF in half i iff bit i of `bits` is set: the same for a 16-bit pair.
__device__ __forceinline__ uint32_t HalfMask(uint32_t bits) {
  return ((bits & 1u) ? 0x0000FFFFu : 0u) | ((bits & 2u) ? 0xFFFF0000u : 0u);
}

// A bf16 query on fp8 caches runs the f16 products as query * q_scale, a power
// of two that puts the largest |q| in [2^14, 2^15): every bf16 value down to
// 2^-31 of that maximum stays exact in f16 (f16 keeps more mantissa bits than
// bf16; smaller ones lose low bits as f16 subnormals), and the scale is divided
// out of the logits exactly. 1 for an all-zero
// or non-finite maximum.
__device__ __forceinline__ float F16QueryScale(float amax) {
  if (!(amax > 0.0f && amax <= FLT_MAX)) return 1.0f;
  int e = 0;
  (void)frexpf(amax, &e);  // amax in [2^(e-1), 2^e)
  return ldexpf(1.0f, min(max(15 - e, -126), 64));
}
__device__ __forceinline__ float Bf16PairAbsMax(uint32_t v) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return fmaxf(fabsf(f.x), fabsf(f.y));
}
__device__ __forceinline__ uint32_t Bf16PairToF16(uint32_t v, float scale) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return PackPair<__half>(f.x * scale, f.y * scale);
}

}  // namespace sm80
}  // namespace cuda
}  // namespace jax_paged
