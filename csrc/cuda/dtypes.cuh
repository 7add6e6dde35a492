// CUDA storage types for each ScalarKind, and the small vector helpers the
// kernels use: 2..16-byte vector loads that convert to fp32 registers, fp32
// shared-memory vector loads, fp32 dot products. Framework-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "params.h"

namespace jax_paged {
namespace cuda {

// ScalarKind -> CUDA storage type (the CUDA twin of cpu::CpuScalar).
template <ScalarKind K>
struct CudaScalar;
template <>
struct CudaScalar<ScalarKind::kF32> {
  using type = float;
};
template <>
struct CudaScalar<ScalarKind::kF16> {
  using type = __half;
};
template <>
struct CudaScalar<ScalarKind::kBF16> {
  using type = __nv_bfloat16;
};
template <ScalarKind K>
using CudaScalarT = typename CudaScalar<K>::type;

// fp8 cache storage types (CacheKind -> CUDA type) and their interpretation.
template <CacheKind K>
struct CudaFp8;
template <>
struct CudaFp8<CacheKind::kFp8E4M3> {
  using type = __nv_fp8_e4m3;
};
template <>
struct CudaFp8<CacheKind::kFp8E5M2> {
  using type = __nv_fp8_e5m2;
};
template <CacheKind K>
using CudaFp8T = typename CudaFp8<K>::type;

template <typename T>
struct Fp8Traits {
  static constexpr bool kIsFp8 = false;
};
template <>
struct Fp8Traits<__nv_fp8_e4m3> {
  static constexpr bool kIsFp8 = true;
  static constexpr __nv_fp8_interpretation_t kInterp = __NV_E4M3;
};
template <>
struct Fp8Traits<__nv_fp8_e5m2> {
  static constexpr bool kIsFp8 = true;
  static constexpr __nv_fp8_interpretation_t kInterp = __NV_E5M2;
};
template <typename T>
constexpr bool kIsFp8 = Fp8Traits<T>::kIsFp8;

// ---- scalar conversions ---------------------------------------------------
__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__nv_fp8_e4m3 v) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.__x, __NV_E4M3)));
}
__device__ __forceinline__ float ToFloat(__nv_fp8_e5m2 v) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.__x, __NV_E5M2)));
}

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
// fp8: round to nearest even, saturating to the largest finite value (NaN
// stays NaN): the cache write's quantisation.
template <>
__device__ __forceinline__ __nv_fp8_e4m3 FromFloat<__nv_fp8_e4m3>(float v) {
  __nv_fp8_e4m3 out;
  out.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  return out;
}
template <>
__device__ __forceinline__ __nv_fp8_e5m2 FromFloat<__nv_fp8_e5m2>(float v) {
  __nv_fp8_e5m2 out;
  out.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
  return out;
}

// ---- raw vectors ----------------------------------------------------------
// An unsigned type of exactly BYTES bytes (and that alignment), so that one
// load instruction moves the whole vector.
template <int BYTES>
struct RawBytes;
template <>
struct RawBytes<1> {
  using type = unsigned char;
};
template <>
struct RawBytes<2> {
  using type = unsigned short;
};
template <>
struct RawBytes<4> {
  using type = unsigned int;
};
template <>
struct RawBytes<8> {
  using type = uint2;
};
template <>
struct RawBytes<16> {
  using type = uint4;
};

// Loads N consecutive elements of T (N * sizeof(T) <= 16 bytes, aligned to
// that size) with one vector load and converts them to fp32.
template <typename T, int N>
__device__ __forceinline__ void LoadToFloat(const T* __restrict__ ptr, float (&out)[N]) {
  static_assert(N * sizeof(T) <= 16, "vector wider than 16 bytes");
  using Raw = typename RawBytes<static_cast<int>(N * sizeof(T))>::type;
  const Raw raw = *reinterpret_cast<const Raw*>(ptr);
  if constexpr (kIsFp8<T> && N % 2 == 0) {
    // Pairs of fp8 -> half2 (one cvt instruction on sm_89+) -> float2.
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = __half22float2(
          __half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], Fp8Traits<T>::kInterp)));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
    const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = ToFloat(elems[i]);
  }
}

// Loads N fp32 values from (shared) memory, 16 bytes at a time where N
// allows. `ptr` must be aligned to min(16, 4 * N) bytes.
template <int N>
__device__ __forceinline__ void LoadFloats(const float* ptr, float (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(ptr + i);
      out[i] = v.x;
      out[i + 1] = v.y;
      out[i + 2] = v.z;
      out[i + 3] = v.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 v = *reinterpret_cast<const float2*>(ptr + i);
      out[i] = v.x;
      out[i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = ptr[i];
  }
}

// Stores N fp32 values, 16 bytes at a time where N allows (same alignment
// rule as LoadFloats).
template <int N>
__device__ __forceinline__ void StoreFloats(float* ptr, const float (&in)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4)
      *reinterpret_cast<float4*>(ptr + i) = make_float4(in[i], in[i + 1], in[i + 2], in[i + 3]);
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2)
      *reinterpret_cast<float2*>(ptr + i) = make_float2(in[i], in[i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) ptr[i] = in[i];
  }
}

// acc + sum_i a[i] * b[i], fp32.
template <int N>
__device__ __forceinline__ float DotAcc(const float (&a)[N], const float (&b)[N], float acc) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc = fmaf(a[i], b[i], acc);
  return acc;
}

// ---- warp reductions ------------------------------------------------------
// Butterfly reductions over the lanes that differ in the bits [LO, HI) of the
// lane index; every participating lane ends with the result. All 32 lanes
// must call them (warp-uniform control flow).
template <int HI, int LO = 1>
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int mask = HI / 2; mask >= LO; mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}
template <int HI, int LO = 1>
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int mask = HI / 2; mask >= LO; mask /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
  return v;
}

}  // namespace cuda
}  // namespace jax_paged
