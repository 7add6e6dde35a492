// Warpgroup matrix products (wgmma, sm_90a) for the grouped kernel's 64-row
// CTAs (grouped_attention.cuh, kWgmma). Framework-free.
//
// The four warps of a CTA are one warpgroup: wgmma.m64nNk16 multiplies the
// CTA's 64 query rows (A, in registers, warp w holding rows 16w..16w+15 in
// mma.m16n8k16's A layout) by N columns of B read by the tensor cores from
// shared memory through a matrix descriptor; the f32 accumulators come back
// in mma.m16n8k16's C layout, one 8-column n-tile after the other. So the
// kernel's fragments (its S and O tiles, P as A) are those of its mma.sync
// path, and only the products change.
//
// Used by the kWgmma kernels (compute capability 9.0; KernelOptions::wgmma).
// Compiled only where __CUDA_ARCH_FEAT_SM90_ALL is defined (the sm_90a
// target, instances/wgmma_grouped_*.cu); elsewhere the wrappers trap.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jax_paged {
namespace cuda {
namespace grouped {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_PAGED_WGMMA_DEVICE 1
#else
#define JAX_PAGED_WGMMA_DEVICE 0
#endif

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"):
// start address, leading and stride byte offsets (all >> 4), swizzle mode in
// bits 62-63. The start address is added per product (desc + (addr >> 4)).
enum class SmemSwizzle : uint32_t { kNone = 0, k64B = 2, k32B = 3 };
__host__ __device__ constexpr uint64_t SmemDescriptor(uint32_t lbo_bytes, uint32_t sbo_bytes,
                                                      SmemSwizzle mode) {
  return (static_cast<uint64_t>((lbo_bytes & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3FFFFu) >> 4) << 32) |
         (static_cast<uint64_t>(mode) << 62);
}
__device__ __forceinline__ uint64_t WithStart(uint64_t desc, uint32_t smem_addr) {
  return desc + ((smem_addr & 0x3FFFFu) >> 4);  // 14 bits: no carry out (< 256 KB)
}

__device__ __forceinline__ void WgmmaFence() {
#if JAX_PAGED_WGMMA_DEVICE
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void WgmmaCommit() {
#if JAX_PAGED_WGMMA_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void WgmmaWaitAll() {
#if JAX_PAGED_WGMMA_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}

#define JAX_PAGED_WG_A4(a) "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])
// (d0, d1[, d2, d3]) (+)= a * B: 64 x 16 (or 32) x 16, B's columns from `desc`
// (K-major), in n-tiles d0 (columns 0-7), d1, ... kAccumulate false: = a * B
// (the old values unused).
#define JAX_PAGED_WG_RW_(x) "+f"(x)
#define JAX_PAGED_WG_W_(x) "=f"(x)
#define JAX_PAGED_WG_TILE_(C, d) C(d[0]), C(d[1]), C(d[2]), C(d[3])
// o[N0 .. N0 + 8) (+)= a * B, one m64n64 product: SHAPE_TYPES its shape and operand
// types ("k16.f32.bf16.bf16"), SCALE_D "1" (accumulate) or "0" (with C = W_), TAIL
// the operands after the scale-d (imm-scale-a, -b and tnspB).
#define JAX_PAGED_WG_N64_(SHAPE_TYPES, SCALE_D, TAIL, C)                                     \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64" SHAPE_TYPES " "                         \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "     \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
               "{%32, %33, %34, %35}, %36, " SCALE_D TAIL ";"                                \
               : JAX_PAGED_WG_TILE_(C, o[N0 + 0]), JAX_PAGED_WG_TILE_(C, o[N0 + 1]),          \
                 JAX_PAGED_WG_TILE_(C, o[N0 + 2]), JAX_PAGED_WG_TILE_(C, o[N0 + 3]),          \
                 JAX_PAGED_WG_TILE_(C, o[N0 + 4]), JAX_PAGED_WG_TILE_(C, o[N0 + 5]),          \
                 JAX_PAGED_WG_TILE_(C, o[N0 + 6]), JAX_PAGED_WG_TILE_(C, o[N0 + 7])           \
               : JAX_PAGED_WG_A4(a), "l"(desc))
#define JAX_PAGED_WG_N16_(TYPES, C)                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                            \
               "wgmma.mma_async.sync.aligned.m64n16k16.f32." TYPES " "                  \
               "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}" \
               : JAX_PAGED_WG_TILE_(C, d0), JAX_PAGED_WG_TILE_(C, d1)                    \
               : JAX_PAGED_WG_A4(a), "l"(desc), "r"(kAccumulate ? 1 : 0))
#define JAX_PAGED_WG_N32_(TYPES, C)                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                            \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPES " "                  \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
               "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"                              \
               : JAX_PAGED_WG_TILE_(C, d0), JAX_PAGED_WG_TILE_(C, d1),                   \
                 JAX_PAGED_WG_TILE_(C, d2), JAX_PAGED_WG_TILE_(C, d3)                    \
               : JAX_PAGED_WG_A4(a), "l"(desc), "r"(kAccumulate ? 1 : 0))
#define JAX_PAGED_WG_DISPATCH_(OP)                                                      \
  if constexpr (std::is_same_v<T, __nv_bfloat16> && kAccumulate) {                     \
    OP("bf16.bf16", JAX_PAGED_WG_RW_);                                                  \
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {                              \
    OP("bf16.bf16", JAX_PAGED_WG_W_);                                                   \
  } else if constexpr (kAccumulate) {                                                   \
    OP("f16.f16", JAX_PAGED_WG_RW_);                                                    \
  } else {                                                                              \
    OP("f16.f16", JAX_PAGED_WG_W_);                                                     \
  }
template <typename T, bool kAccumulate>
__device__ __forceinline__ void WgmmaN16(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4],
                                         uint64_t desc) {
#if JAX_PAGED_WGMMA_DEVICE
  JAX_PAGED_WG_DISPATCH_(JAX_PAGED_WG_N16_)
#else
  __trap();
#endif
}
template <typename T, bool kAccumulate>
__device__ __forceinline__ void WgmmaN32(float (&d0)[4], float (&d1)[4], float (&d2)[4],
                                         float (&d3)[4], const uint32_t (&a)[4], uint64_t desc) {
#if JAX_PAGED_WGMMA_DEVICE
  JAX_PAGED_WG_DISPATCH_(JAX_PAGED_WG_N32_)
#else
  __trap();
#endif
}
#undef JAX_PAGED_WG_DISPATCH_
#undef JAX_PAGED_WG_N32_
#undef JAX_PAGED_WG_N16_

// o[N0 .. N0 + N/8) += a * B: 64 x N x 16 (N = 16, 32 or 64), B's N columns
// from `desc` (K-major).
template <typename T, int N, int N0, int kNT>
__device__ __forceinline__ void WgmmaAcc(float (&o)[kNT][4], const uint32_t (&a)[4],
                                         uint64_t desc) {
  static_assert(N0 + N / 8 <= kNT, "n-tiles");
#if JAX_PAGED_WGMMA_DEVICE
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 16) {
    WgmmaN16<T, true>(o[N0], o[N0 + 1], a, desc);
  } else if constexpr (N == 32) {
    WgmmaN32<T, true>(o[N0], o[N0 + 1], o[N0 + 2], o[N0 + 3], a, desc);
  } else {
    static_assert(N == 64, "N = 16, 32 or 64");
    if constexpr (kBf16) {
      JAX_PAGED_WG_N64_("k16.f32.bf16.bf16", "1", ", 1, 1, 0", JAX_PAGED_WG_RW_);
    } else {
      JAX_PAGED_WG_N64_("k16.f32.f16.f16", "1", ", 1, 1, 0", JAX_PAGED_WG_RW_);
    }
  }
#else
  __trap();
#endif
}

// o += a * B over all kNT n-tiles (8 * kNT columns), in products of 64, 32
// and 16 columns; column c's descriptor is desc_of(c) (first column of a product).
template <typename T, int N0, int kNT, typename DescOf>
__device__ __forceinline__ void WgmmaAccAll(float (&o)[kNT][4], const uint32_t (&a)[4],
                                            DescOf&& desc_of) {
  if constexpr (N0 < kNT) {
    constexpr int kLeft = (kNT - N0) * 8;
    constexpr int kN = kLeft >= 64 ? 64 : (kLeft >= 32 ? 32 : 16);
    static_assert(kLeft % 16 == 0, "columns in products of 16");
    WgmmaAcc<T, kN, N0, kNT>(o, a, desc_of(N0 * 8));
    WgmmaAccAll<T, N0 + kN / 8, kNT>(o, a, desc_of);
  }
}

#undef JAX_PAGED_WG_N64_
#undef JAX_PAGED_WG_TILE_
#undef JAX_PAGED_WG_W_
#undef JAX_PAGED_WG_RW_
#undef JAX_PAGED_WG_A4

}  // namespace grouped
}  // namespace cuda
}  // namespace jax_paged
