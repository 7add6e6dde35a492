// XLA FFI handler of the split-KV, GQA-grouped decode kernel
// (jax_paged_attention_grouped): the extended V2 contract (operands,
// attributes and results, workspace and lse included; see
// BindAttentionOperands), a different kernel (kernels/grouped_attention.cuh).
// Unpack + check (common.h), dtype dispatch (DispatchScalar, DispatchFp8:
// fp8 caches with f16/bf16 queries), head-size dispatch (cuda_dispatch.cuh);
// no allocation, no host synchronisation (command-buffer compatible). Compiles no kernel: the launchers are
// instantiated in cuda_grouped_{f32,f16,bf16,fp8e4m3,fp8e5m2}.cu.
#include <cuda_runtime.h>

#include "xla_ffi.h"

#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../kernels/dtypes.cuh"
#include "../kernels/grouped_launch.h"
#include "../kernels/launch.h"
#include "common.h"
#include "cuda_dispatch.cuh"
#include "handlers.h"

namespace jax_paged {
namespace cuda {
namespace grouped {

size_t GroupedSmemBytes(ScalarKind query_kind, CacheKind cache_kind, int head_size) {
  size_t bytes = 0;
#define JAX_PAGED_GROUPED_SMEM_(QELEM, CELEM, H) \
  if (head_size == H) bytes = GroupedConfig<QELEM, CELEM, H>::kSmemBytes;
  if (cache_kind != CacheKind::kSameAsQuery) {
    if (query_kind == ScalarKind::kF32) return 0;  // fp8 caches need a 16-bit query
    JAX_PAGED_FP8_HEAD_SIZES_A(JAX_PAGED_GROUPED_SMEM_, 2, 1)
    JAX_PAGED_FP8_HEAD_SIZES_B(JAX_PAGED_GROUPED_SMEM_, 2, 1)
  } else if (query_kind == ScalarKind::kF32) {
    JAX_PAGED_HEAD_SIZES(JAX_PAGED_GROUPED_SMEM_, 4, 4)
  } else {
    JAX_PAGED_HEAD_SIZES(JAX_PAGED_GROUPED_SMEM_, 2, 2)
  }
#undef JAX_PAGED_GROUPED_SMEM_
  return bytes;
}

}  // namespace grouped
}  // namespace cuda

namespace {

using cuda::CudaScalarT;

ffi::Error CudaError(const char* op, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_paged: CUDA error in ") + op + ": " +
                              cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

ffi::Error PagedAttentionGroupedCuda(cudaStream_t stream, ffi::AnyBuffer query,
                                     ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                     ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                                     ffi::AnyBuffer alibi, ffi::AnyBuffer k_scale,
                                     ffi::AnyBuffer v_scale, float scale, float soft_cap,
                                     int64_t sliding_window, int64_t partition_size,
                                     ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::AnyBuffer> lse,
                                     ffi::Result<ffi::AnyBuffer> exp_sums,
                                     ffi::Result<ffi::AnyBuffer> max_logits,
                                     ffi::Result<ffi::AnyBuffer> tmp_out) {
  constexpr const char* op = "paged_attention_grouped";
  PagedAttentionParams p;
  ScalarKind kind = ScalarKind::kF32;
  if (auto err = UnpackPagedAttentionExt(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi, k_scale, v_scale, soft_cap, sliding_window, *out,
                                         *lse, &p, &kind);
      err.failure())
    return err;
  if (partition_size > INT_MAX)
    return ArgError(std::string(op) + ": partition_size " + std::to_string(partition_size) +
                    " overflows int32");
  if (auto err = UnpackPartitions(partition_size, *exp_sums, *max_logits, *tmp_out, &p);
      err.failure())
    return err;
  p.scale = scale;

  if (!cuda::IsSupportedHeadSize(p.head_size)) return cuda::UnsupportedHeadSize(p.head_size);
  if (p.block_size != 8 && p.block_size != 16 && p.block_size != 32)
    return ArgError(std::string(op) + ": block_size must be 8, 16 or 32, got " +
                    std::to_string(p.block_size));
  const bool fp8 = p.cache_kind != CacheKind::kSameAsQuery;
  if (fp8 && kind == ScalarKind::kF32)
    return ArgError(std::string(op) + ": fp8 caches need a float16 or bfloat16 query here, got "
                    "float32; use impl=\"v2\"");
  if (fp8 && p.head_size % 16 != 0)
    return ArgError(std::string(op) + ": fp8 caches need head_size % 16 == 0, got " +
                    std::to_string(p.head_size));
  if (p.num_seqs == 0 || p.num_heads == 0) return ffi::Error::Success();  // nothing to write
  if (!Aligned16(p.query) || !Aligned16(p.key_cache) || !Aligned16(p.value_cache) ||
      !Aligned16(p.out))
    return ArgError(std::string(op) + ": query, caches and out must be 16-byte aligned");
  const int64_t capacity = int64_t{p.max_blocks_per_seq} * p.block_size;
  if (capacity > INT_MAX)
    return ArgError(std::string(op) + ": max_blocks_per_seq * block_size overflows int32");
  if (p.max_num_partitions > cuda::kMaxGridYZ)
    return ArgError(std::string(op) + ": " + std::to_string(p.max_num_partitions) +
                    " partitions exceed the CUDA grid limit of " +
                    std::to_string(cuda::kMaxGridYZ) + "; use a larger partition_size");
  if (int64_t{p.num_heads} * p.q_len > INT_MAX)
    return ArgError(std::string(op) + ": num_heads * q_len overflows the grid");

  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return CudaError(op, err);
  const int major = cuda::ComputeCapabilityMajor(device);
  if (major > 0 && major < 9)
    return ArgError(std::string(op) + ": the grouped kernel needs compute capability 9.0 "
                    "(Hopper) or newer (bulk copies); use impl=\"v2\" on this GPU");
  const size_t smem = cuda::grouped::GroupedSmemBytes(kind, p.cache_kind, p.head_size);
  const int optin = cuda::MaxSharedMemoryOptin(device);
  if (optin > 0 && smem > static_cast<size_t>(optin))
    return ArgError(std::string(op) + ": needs " + std::to_string(smem) +
                    " bytes of shared memory per block, more than this GPU's " +
                    std::to_string(optin) + "; use impl=\"v2\"");

  auto launch = [&](auto query_type, auto cache_type) {
    using T = decltype(query_type);
    using TC = decltype(cache_type);
    return cuda::DispatchHeadSize(p.head_size, [&](auto head) -> ffi::Error {
      constexpr int kHead = decltype(head)::value;
      if constexpr (sizeof(TC) == 1 && kHead % 16 != 0) {
        return ffi::Error::Internal("unreachable: fp8 head size checked above");
      } else {
        const cudaError_t err =
            cuda::grouped::LaunchGroupedAttention<T, TC, kHead>(p, device, stream);
        return err == cudaSuccess ? ffi::Error::Success() : CudaError(op, err);
      }
    });
  };
  if (!fp8) {
    return DispatchScalar(kind, [&](auto tag) {
      using T = CudaScalarT<decltype(tag)::value>;
      return launch(T{}, T{});
    });
  }
  return DispatchScalar(kind, [&](auto tag) -> ffi::Error {
    using T = CudaScalarT<decltype(tag)::value>;
    if constexpr (std::is_same_v<T, float>) {
      return ffi::Error::Internal("unreachable: fp8 with a float32 query checked above");
    } else {
      return DispatchFp8(p.cache_kind, [&](auto ctag) {
        return launch(T{}, cuda::CudaFp8T<decltype(ctag)::value>{});
      });
    }
  });
}

}  // namespace
}  // namespace jax_paged

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedAttentionGroupedCuda, jax_paged::PagedAttentionGroupedCuda,
                              jax_paged::BindAttentionOperands(
                                  xla::ffi::Ffi::Bind()
                                      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
                                  .Attr<int64_t>("partition_size")
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>()   // lse
                                  .Ret<xla::ffi::AnyBuffer>()   // exp_sums
                                  .Ret<xla::ffi::AnyBuffer>()   // max_logits
                                  .Ret<xla::ffi::AnyBuffer>(),  // tmp_out
                              {xla::ffi::Traits::kCmdBufferCompatible});
