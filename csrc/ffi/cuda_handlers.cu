// XLA FFI handlers for the CUDA kernels: unpack + check (common.h), dispatch
// on dtype (DispatchScalar), head size and block size (cuda_dispatch.cuh),
// launch on XLA's stream. No allocation and no host synchronisation here, so
// the handlers are CUDA-graph (command buffer) compatible: the V2 workspace
// comes in as extra results.
//
// This TU compiles no attention kernel: the launchers are only declared
// (kernels/launch.h) and explicitly instantiated in cuda_attn_*.cu and
// cuda_cache_ops.cu.
#include <cuda_runtime.h>

#include "ffi/xla_ffi.h"

#include <climits>
#include <cstdint>
#include <string>

#include "cuda/dtypes.cuh"
#include "cuda/launch.h"
#include "ffi/common.h"
#include "ffi/cuda_dispatch.cuh"
#include "ffi/handlers.h"

namespace jax_paged {
namespace {

using cuda::Aligned16;
using cuda::CudaError;
using cuda::CudaScalarT;

// See UnaliasedCaches (common.h): normally a no-op. The copy is an async
// device-to-device copy on the handler's stream, so it stays capturable in a
// CUDA graph and ordered before the kernel that writes the result.
ffi::Error CopyUnaliasedCaches(const UnaliasedCaches& c, cudaStream_t stream) {
  for (int i = 0; i < c.count; ++i) {
    const cudaError_t err =
        cudaMemcpyAsync(c.dst[i], c.src[i], c.bytes[i], cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return CudaError("copying an unaliased cache", err);
  }
  return ffi::Error::Success();
}

ffi::Error RunPagedAttention(cudaStream_t stream, PagedAttentionParams& p, ScalarKind kind,
                             bool v2) {
  const char* op = v2 ? "paged_attention_v2" : "paged_attention_v1";
  if (!cuda::IsSupportedHeadSize(p.head_size)) return cuda::UnsupportedHeadSize(p.head_size);
  if (!cuda::IsSupportedBlockSize(p.block_size)) return cuda::UnsupportedBlockSize(p.block_size);
  if (p.num_seqs == 0 || p.num_heads == 0) return ffi::Error::Success();  // nothing to write
  if (auto err = cuda::CheckAttentionLaunch(p, op, v2); err.failure()) return err;
  const int64_t capacity = int64_t{p.max_blocks_per_seq} * p.block_size;

  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return CudaError(op, err);
  // V1 logits: the whole table, or at most the blocks a sliding window touches.
  int64_t v1_slots = capacity;
  if (p.sliding_window > 0) {
    const int64_t window_blocks = (int64_t{p.sliding_window} + p.block_size - 1) / p.block_size;
    v1_slots = std::min(capacity, (window_blocks + 1) * p.block_size);
  }
  const int64_t logit_slots = v2 ? p.partition_size : v1_slots;
  const size_t smem = cuda::PagedAttentionSmemBytes(p.head_size, logit_slots);
  const int optin = cuda::MaxSharedMemoryOptin(device);
  if (optin > 0 && smem > static_cast<size_t>(optin)) {
    if (v2)
      return ArgError("paged_attention_v2: partition_size " + std::to_string(p.partition_size) +
                      " needs " + std::to_string(smem) +
                      " bytes of shared memory per block, more than this GPU's " +
                      std::to_string(optin) + "; use a smaller partition_size (e.g. 512)");
    return ArgError("paged_attention_v1: a block table of " +
                    std::to_string(p.max_blocks_per_seq) + " blocks x " +
                    std::to_string(p.block_size) + " tokens needs " + std::to_string(smem) +
                    " bytes of shared memory per block for the logits, more than this "
                    "GPU's " + std::to_string(optin) + "; use impl=\"v2\" for long contexts");
  }

  // Dispatch on (query dtype, cache dtype) -> head size -> block size.
  auto launch = [&](auto query_type, auto cache_type) {
    using T = decltype(query_type);
    using TC = decltype(cache_type);
    return cuda::DispatchHeadSize(p.head_size, [&](auto head) -> ffi::Error {
      constexpr int kHead = decltype(head)::value;
      if constexpr (kHead % (16 / sizeof(TC)) != 0) {
        return ArgError(std::string(op) + ": fp8 caches need head_size % 16 == 0, got " +
                        std::to_string(kHead));
      } else {
        return cuda::DispatchBlockSize(p.block_size, [&](auto block) {
          const cudaError_t err =
              cuda::LaunchPagedAttention<T, TC, kHead, decltype(block)::value>(p, v2, smem,
                                                                               device, stream);
          return err == cudaSuccess ? ffi::Error::Success() : CudaError(op, err);
        });
      }
    });
  };
  if (p.cache_kind == CacheKind::kSameAsQuery) {
    return DispatchScalar(kind, [&](auto tag) {
      using T = CudaScalarT<decltype(tag)::value>;
      return launch(T{}, T{});
    });
  }
  // fp8 caches: one instantiation per cache type, the query dtype at run time.
  return DispatchFp8(p.cache_kind, [&](auto ctag) {
    return launch(cuda::RuntimeFloat{}, cuda::CudaFp8T<decltype(ctag)::value>{});
  });
}

ffi::Error PagedAttentionV1Cuda(cudaStream_t stream, ffi::AnyBuffer query,
                                ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                                ffi::AnyBuffer alibi, ffi::AnyBuffer k_scale,
                                ffi::AnyBuffer v_scale, float scale, float soft_cap,
                                int64_t sliding_window, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> lse) {
  PagedAttentionParams p;
  ScalarKind kind = ScalarKind::kF32;
  if (auto err = UnpackPagedAttentionExt(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi, k_scale, v_scale, soft_cap, sliding_window, *out,
                                         *lse, &p, &kind);
      err.failure())
    return err;
  p.scale = scale;
  return RunPagedAttention(stream, p, kind, /*v2=*/false);
}

ffi::Error RunPagedAttentionV2(cudaStream_t stream, PagedAttentionParams& p, ScalarKind kind) {
  return RunPagedAttention(stream, p, kind, /*v2=*/true);
}

ffi::Error ReshapeAndCacheCuda(cudaStream_t stream, ffi::AnyBuffer key, ffi::AnyBuffer value,
                               ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                               ffi::AnyBuffer slot_mapping, ffi::AnyBuffer k_scale,
                               ffi::AnyBuffer v_scale,
                               ffi::Result<ffi::AnyBuffer> key_cache_out,
                               ffi::Result<ffi::AnyBuffer> value_cache_out) {
  ReshapeAndCacheParams p;
  ScalarKind kind = ScalarKind::kF32;
  if (auto err = UnpackReshapeAndCache(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                       v_scale, key_cache_out, value_cache_out, &p, &kind);
      err.failure())
    return err;
  if (auto err = CopyUnaliasedCaches(
          FindUnaliasedCaches(key_cache, value_cache, key_cache_out, value_cache_out), stream);
      err.failure())
    return err;
  if (p.num_tokens == 0 || p.num_kv_heads == 0 || p.head_size == 0 || p.num_blocks == 0)
    return ffi::Error::Success();  // nothing to write (or nowhere to write it)
  // 16-byte stores into the K cache; 16-byte loads of the keys when they are
  // copied as they are (not quantised).
  if (!Aligned16(p.key_cache) || (p.cache_kind == CacheKind::kSameAsQuery && !Aligned16(p.key)))
    return ArgError("reshape_and_cache: key and key_cache must be 16-byte aligned");
  return cuda::DispatchQueryAndCache(kind, p.cache_kind, [&](auto key_type, auto cache_type) {
    const cudaError_t err =
        cuda::LaunchReshapeAndCache<decltype(key_type), decltype(cache_type)>(p, stream);
    return err == cudaSuccess ? ffi::Error::Success() : CudaError("reshape_and_cache", err);
  });
}

ffi::Error CopyBlocksCuda(cudaStream_t stream, ffi::AnyBuffer key_cache,
                          ffi::AnyBuffer value_cache, ffi::AnyBuffer block_mapping,
                          ffi::Result<ffi::AnyBuffer> key_cache_out,
                          ffi::Result<ffi::AnyBuffer> value_cache_out) {
  CopyBlocksParams p;
  int elem_size = 0;
  if (auto err = UnpackCopyBlocks(key_cache, value_cache, block_mapping, key_cache_out,
                                  value_cache_out, &p, &elem_size);
      err.failure())
    return err;
  if (auto err = CopyUnaliasedCaches(
          FindUnaliasedCaches(key_cache, value_cache, key_cache_out, value_cache_out), stream);
      err.failure())
    return err;
  if (p.num_pairs == 0 || p.block_elems == 0) return ffi::Error::Success();
  // Copying is dtype-agnostic: only the element size matters.
  const cudaError_t err = cuda::LaunchCopyBlocks(p, elem_size, stream);
  return err == cudaSuccess ? ffi::Error::Success() : CudaError("copy_blocks", err);
}

}  // namespace

// Every CUDA handler runs on XLA's stream for the computation.
inline auto StreamBinding() {
  return xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>();
}

}  // namespace jax_paged

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedAttentionV1Cuda, jax_paged::PagedAttentionV1Cuda,
                              jax_paged::BindAttentionOperands(jax_paged::StreamBinding())
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>(),  // lse
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedAttentionV2Cuda,
                              jax_paged::cuda::PartitionedAttention<jax_paged::RunPagedAttentionV2>,
                              jax_paged::PartitionedAttentionBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedReshapeAndCacheCuda, jax_paged::ReshapeAndCacheCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // key
                                  .Arg<xla::ffi::AnyBuffer>()  // value
                                  .Arg<xla::ffi::AnyBuffer>()  // key_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // value_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // slot_mapping
                                  .Arg<xla::ffi::AnyBuffer>()  // k_scale
                                  .Arg<xla::ffi::AnyBuffer>()  // v_scale
                                  .Ret<xla::ffi::AnyBuffer>()   // key_cache (aliased)
                                  .Ret<xla::ffi::AnyBuffer>(),  // value_cache (aliased)
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedCopyBlocksCuda, jax_paged::CopyBlocksCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // key_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // value_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // block_mapping
                                  .Ret<xla::ffi::AnyBuffer>()   // key_cache (aliased)
                                  .Ret<xla::ffi::AnyBuffer>(),  // value_cache (aliased)
                              {xla::ffi::Traits::kCmdBufferCompatible});
