// Paged-cache write (reshape_and_cache) and block copy (copy_blocks) kernels.
// Framework-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/dtypes.cuh"
#include "cuda/launch.h"
#include "params.h"

namespace jax_paged {
namespace cuda {

constexpr int kCacheThreads = 256;

// Cache element of a key/value element: the element itself when the cache
// has its dtype, else value / scale quantised to fp8 (round to nearest even,
// saturating to the format's largest finite value: FromFloat<fp8>).
template <typename TIN, typename TC>
__device__ __forceinline__ TC ToCacheElem(TIN v, float scale) {
  if constexpr (std::is_same_v<TIN, TC>) {
    return v;
  } else {
    return FromFloat<TC>(__fdiv_rn(ToFloat(v), scale));
  }
}

// One CTA per token. key/value [num_tokens, num_kv_heads, head_size] (TIN) go
// to slot = slot_mapping[token] (block = slot / B, offset = slot % B) of
// caches of TC (TIN, or fp8 with k_scale / v_scale):
//   key_cache   [num_blocks, num_kv_heads, head_size / x, B, x]: each x-chunk
//               (16 bytes) is contiguous in the cache -> one 16-byte store per
//               chunk (a 16-byte copy when TC == TIN);
//   value_cache [num_blocks, num_kv_heads, head_size, B]: element-wise.
// Slots < 0 or >= num_blocks * B are skipped (computed in int64).
template <typename TIN, typename TC>
__global__ void __launch_bounds__(kCacheThreads)
    ReshapeAndCacheKernel(const ReshapeAndCacheParams p) {
  constexpr bool kQuant = !std::is_same_v<TIN, TC>;
  static_assert(!kQuant || sizeof(TC) == 1, "a cache of another dtype is fp8");
  constexpr int X = 16 / static_cast<int>(sizeof(TC));
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  const int64_t B = p.block_size;
  if (slot < 0 || slot >= p.num_blocks * B) return;
  const int64_t block = slot / B;
  const int64_t offset = slot % B;
  const int H = p.num_kv_heads;
  const int D = p.head_size;
  const int chunks_per_head = D / X;  // D % X == 0 (checked by the FFI layer)
  const int64_t row_elems = static_cast<int64_t>(H) * D;

  const TIN* key = static_cast<const TIN*>(p.key) + token * row_elems;
  TC* key_cache = static_cast<TC*>(p.key_cache);
  for (int c = threadIdx.x; c < H * chunks_per_head; c += kCacheThreads) {
    const int h = c / chunks_per_head;
    const int cx = c % chunks_per_head;
    const int64_t dst = (((block * H + h) * chunks_per_head + cx) * B + offset) * X;
    uint4 packed;
    if constexpr (kQuant) {
      const float ks = p.k_scale != nullptr ? p.k_scale[h * p.k_scale_stride] : 1.0f;
      TC* out = reinterpret_cast<TC*>(&packed);
#pragma unroll
      for (int i = 0; i < X; ++i)
        out[i] = ToCacheElem<TIN, TC>(key[static_cast<int64_t>(c) * X + i], ks);
    } else {
      packed = *reinterpret_cast<const uint4*>(key + static_cast<int64_t>(c) * X);
    }
    *reinterpret_cast<uint4*>(key_cache + dst) = packed;
  }

  const TIN* value = static_cast<const TIN*>(p.value) + token * row_elems;
  TC* value_cache = static_cast<TC*>(p.value_cache);
  for (int i = threadIdx.x; i < H * D; i += kCacheThreads) {
    const int h = i / D;
    const int d = i % D;
    const float vs = kQuant && p.v_scale != nullptr ? p.v_scale[h * p.v_scale_stride] : 1.0f;
    value_cache[((block * H + h) * D + d) * B + offset] = ToCacheElem<TIN, TC>(value[i], vs);
  }
}

template <typename TIN, typename TC>
cudaError_t LaunchReshapeAndCache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  ReshapeAndCacheKernel<TIN, TC><<<p.num_tokens, kCacheThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// grid (num_pairs, 2): blockIdx.y selects the key (0) or value (1) cache.
// Copies the `units` units of type U of block src over block dst. Pairs with
// src or dst outside [0, num_blocks) are skipped; src == dst is a no-op.
template <typename U>
__global__ void __launch_bounds__(kCacheThreads)
    CopyBlocksKernel(void* key_cache, void* value_cache, const int32_t* block_mapping,
                     int64_t num_blocks, int64_t units_per_block) {
  const int64_t pair = blockIdx.x;
  const int64_t src = block_mapping[2 * pair];
  const int64_t dst = block_mapping[2 * pair + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks || src == dst) return;
  U* cache = static_cast<U*>(blockIdx.y == 0 ? key_cache : value_cache);
  const U* from = cache + src * units_per_block;
  U* to = cache + dst * units_per_block;
  for (int64_t i = threadIdx.x; i < units_per_block; i += kCacheThreads) to[i] = from[i];
}

// Not inline (declared in launch.h): include this header in exactly one
// translation unit (instances/cache_ops.cu).
cudaError_t LaunchCopyBlocks(const CopyBlocksParams& p, int elem_size, cudaStream_t stream) {
  const int64_t bytes = p.block_elems * elem_size;
  const bool vec16 = bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.key_cache) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(p.value_cache) % 16 == 0;
  const dim3 grid(p.num_pairs, 2);
  if (vec16) {
    CopyBlocksKernel<uint4><<<grid, kCacheThreads, 0, stream>>>(
        p.key_cache, p.value_cache, p.block_mapping, p.num_blocks, bytes / 16);
  } else if (elem_size == 4) {
    CopyBlocksKernel<unsigned int><<<grid, kCacheThreads, 0, stream>>>(
        p.key_cache, p.value_cache, p.block_mapping, p.num_blocks, bytes / 4);
  } else if (elem_size == 2) {
    CopyBlocksKernel<unsigned short><<<grid, kCacheThreads, 0, stream>>>(
        p.key_cache, p.value_cache, p.block_mapping, p.num_blocks, bytes / 2);
  } else {
    CopyBlocksKernel<unsigned char><<<grid, kCacheThreads, 0, stream>>>(
        p.key_cache, p.value_cache, p.block_mapping, p.num_blocks, bytes);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace jax_paged
