// What the CUDA handlers share, in one place: the compile-time size dispatch
// (head size and block size; the dtype dispatch is DispatchScalar in
// common.h), the checks every attention launch needs, and the one handler
// body of the two partitioned targets (V2 and grouped). The lists of
// supported sizes come from kernels/launch.h, the same lists the
// cuda_attn_*.cu files instantiate, so dispatch and instantiation agree.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/dtypes.cuh"
#include "cuda/launch.h"
#include "ffi/common.h"

namespace jax_paged {
namespace cuda {

#define JAX_PAGED_SIZE_STR_(unused, N) " " #N
#define JAX_PAGED_SIZE_CASE_(unused, N) \
  case N:                               \
    return true;

inline bool IsSupportedHeadSize(int head_size) {
  switch (head_size) { JAX_PAGED_HEAD_SIZES(JAX_PAGED_SIZE_CASE_, _) }
  return false;
}
inline bool IsSupportedBlockSize(int block_size) {
  switch (block_size) { JAX_PAGED_BLOCK_SIZES(JAX_PAGED_SIZE_CASE_, _) }
  return false;
}

inline ffi::Error UnsupportedHeadSize(int head_size) {
  return ArgError("the CUDA kernels do not support head_size " + std::to_string(head_size) +
                  "; supported:" JAX_PAGED_HEAD_SIZES(JAX_PAGED_SIZE_STR_, _));
}
inline ffi::Error UnsupportedBlockSize(int block_size) {
  return ArgError("the CUDA kernels do not support block_size " + std::to_string(block_size) +
                  "; supported:" JAX_PAGED_BLOCK_SIZES(JAX_PAGED_SIZE_STR_, _));
}

// Calls f(std::integral_constant<int, HEAD_SIZE>{}), or returns a clear error.
template <typename F>
ffi::Error DispatchHeadSize(int head_size, F&& f) {
#define JAX_PAGED_HEAD_CASE_(unused, N) \
  case N:                               \
    return f(std::integral_constant<int, N>{});
  switch (head_size) { JAX_PAGED_HEAD_SIZES(JAX_PAGED_HEAD_CASE_, _) }
#undef JAX_PAGED_HEAD_CASE_
  return UnsupportedHeadSize(head_size);
}

// Calls f(std::integral_constant<int, BLOCK_SIZE>{}), or returns a clear error.
template <typename F>
ffi::Error DispatchBlockSize(int block_size, F&& f) {
#define JAX_PAGED_BLOCK_CASE_(unused, N) \
  case N:                                \
    return f(std::integral_constant<int, N>{});
  switch (block_size) { JAX_PAGED_BLOCK_SIZES(JAX_PAGED_BLOCK_CASE_, _) }
#undef JAX_PAGED_BLOCK_CASE_
  return UnsupportedBlockSize(block_size);
}

#undef JAX_PAGED_SIZE_CASE_
#undef JAX_PAGED_SIZE_STR_

// Calls f(T{}, TC{}): T the CUDA storage type of `kind` (the query's or the
// new keys' dtype), TC the cache's: T itself, or the fp8 type of cache_kind.
template <typename F>
ffi::Error DispatchQueryAndCache(ScalarKind kind, CacheKind cache_kind, F&& f) {
  return DispatchScalar(kind, [&](auto tag) {
    using T = CudaScalarT<decltype(tag)::value>;
    if (cache_kind == CacheKind::kSameAsQuery) return f(T{}, T{});
    return DispatchFp8(cache_kind, [&](auto ctag) { return f(T{}, CudaFp8T<decltype(ctag)::value>{}); });
  });
}

inline ffi::Error CudaError(const char* op, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_paged: CUDA error in ") + op + ": " +
                              cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

inline bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Checks shared by every attention launch, after unpacking: 16-byte vector
// loads (XLA buffers are at least 16-byte aligned), int32 token positions,
// grid limits (partitions on grid z, heads * q_len on grid x).
inline ffi::Error CheckAttentionLaunch(const PagedAttentionParams& p, const char* op,
                                       bool partitioned) {
  if (!Aligned16(p.query) || !Aligned16(p.key_cache) || !Aligned16(p.value_cache) ||
      !Aligned16(p.out))
    return ArgError(std::string(op) + ": query, caches and out must be 16-byte aligned");
  if (partitioned && !Aligned16(p.tmp_out))  // the grouped kernel stores float4s
    return ArgError(std::string(op) + ": the tmp_out workspace must be 16-byte aligned");
  const int64_t capacity = int64_t{p.max_blocks_per_seq} * p.block_size;
  if (capacity > INT_MAX)
    return ArgError(std::string(op) + ": max_blocks_per_seq * block_size overflows int32");
  if (partitioned && p.max_num_partitions > kMaxGridYZ)
    return ArgError(std::string(op) + ": " + std::to_string(p.max_num_partitions) +
                    " partitions exceed the CUDA grid limit of " + std::to_string(kMaxGridYZ) +
                    "; use a larger partition_size");
  if (int64_t{p.num_heads} * p.q_len > INT_MAX)
    return ArgError(std::string(op) + ": num_heads * q_len overflows the grid");
  return ffi::Error::Success();
}

// Handler body of the partitioned targets (paged_attention_v2 and
// paged_attention_grouped): the extended operands, partition_size and the
// V2 workspace unpacked and checked, then Run(stream, params, query kind).
template <ffi::Error (*Run)(cudaStream_t, PagedAttentionParams&, ScalarKind)>
ffi::Error PartitionedAttention(cudaStream_t stream, ffi::AnyBuffer query,
                                ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                                ffi::AnyBuffer alibi, ffi::AnyBuffer k_scale,
                                ffi::AnyBuffer v_scale, float scale, float soft_cap,
                                int64_t sliding_window, int64_t partition_size,
                                ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                                ffi::Result<ffi::AnyBuffer> exp_sums,
                                ffi::Result<ffi::AnyBuffer> max_logits,
                                ffi::Result<ffi::AnyBuffer> tmp_out) {
  PagedAttentionParams p;
  ScalarKind kind = ScalarKind::kF32;
  if (auto err = UnpackPagedAttentionExt(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi, k_scale, v_scale, soft_cap, sliding_window, *out,
                                         *lse, &p, &kind);
      err.failure())
    return err;
  if (partition_size > INT_MAX)
    return ArgError("partition_size " + std::to_string(partition_size) + " overflows int32");
  if (auto err = UnpackPartitions(partition_size, *exp_sums, *max_logits, *tmp_out, &p);
      err.failure())
    return err;
  p.scale = scale;
  return Run(stream, p, kind);
}

}  // namespace cuda

// Binding of the partitioned targets: the shared operands, partition_size,
// then out, lse and the V2 workspace.
inline auto PartitionedAttentionBinding() {
  return BindAttentionOperands(
             xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
      .Attr<int64_t>("partition_size")
      .Ret<xla::ffi::AnyBuffer>()   // out
      .Ret<xla::ffi::AnyBuffer>()   // lse
      .Ret<xla::ffi::AnyBuffer>()   // exp_sums
      .Ret<xla::ffi::AnyBuffer>()   // max_logits
      .Ret<xla::ffi::AnyBuffer>();  // tmp_out
}

}  // namespace jax_paged
