// XLA FFI handler of the split-KV, GQA-grouped decode kernel
// (jax_paged_attention_grouped): V2's operands, attributes and results
// (workspace included), a different kernel (kernels/grouped_attention.cuh).
// Unpack + check (common.h), dtype dispatch (DispatchScalar), head-size
// dispatch (cuda_dispatch.cuh); no allocation, no host synchronisation
// (command-buffer compatible). Compiles no kernel: the launchers are
// instantiated in cuda_grouped_{f32,f16,bf16}.cu.
#include <cuda_runtime.h>

#include "xla_ffi.h"

#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

#include "../kernels/dtypes.cuh"
#include "../kernels/grouped_launch.h"
#include "../kernels/launch.h"
#include "common.h"
#include "cuda_dispatch.cuh"
#include "handlers.h"

namespace jax_paged {
namespace cuda {
namespace grouped {

size_t GroupedSmemBytes(ScalarKind kind, int head_size) {
  size_t bytes = 0;
#define JAX_PAGED_GROUPED_SMEM_(ELEM, H) \
  if (head_size == H) bytes = GroupedConfig<ELEM, H>::kSmemBytes;
  if (kind == ScalarKind::kF32) {
    JAX_PAGED_HEAD_SIZES(JAX_PAGED_GROUPED_SMEM_, 4)
  } else {
    JAX_PAGED_HEAD_SIZES(JAX_PAGED_GROUPED_SMEM_, 2)
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

// Compute capability major of `device`, queried once per device (0 on failure).
int ComputeMajor(int device) {
  static std::atomic<int> cache[cuda::kMaxDevices] = {};
  if (device >= 0 && device < cuda::kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (device >= 0 && device < cuda::kMaxDevices)
    cache[device].store(major, std::memory_order_relaxed);
  return major;
}

ffi::Error PagedAttentionGroupedCuda(cudaStream_t stream, ffi::AnyBuffer query,
                                     ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                     ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                                     ffi::AnyBuffer alibi, float scale, int64_t partition_size,
                                     ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::AnyBuffer> exp_sums,
                                     ffi::Result<ffi::AnyBuffer> max_logits,
                                     ffi::Result<ffi::AnyBuffer> tmp_out) {
  constexpr const char* op = "paged_attention_grouped";
  PagedAttentionParams p;
  ScalarKind kind = ScalarKind::kF32;
  if (auto err = UnpackPagedAttention(query, key_cache, value_cache, block_tables, seq_lens,
                                      alibi, *out, &p, &kind);
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

  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return CudaError(op, err);
  const int major = ComputeMajor(device);
  if (major > 0 && major < 9)
    return ArgError(std::string(op) + ": the grouped kernel needs compute capability 9.0 "
                    "(Hopper) or newer (bulk copies); use impl=\"v2\" on this GPU");
  const size_t smem = cuda::grouped::GroupedSmemBytes(kind, p.head_size);
  const int optin = cuda::MaxSharedMemoryOptin(device);
  if (optin > 0 && smem > static_cast<size_t>(optin))
    return ArgError(std::string(op) + ": needs " + std::to_string(smem) +
                    " bytes of shared memory per block, more than this GPU's " +
                    std::to_string(optin) + "; use impl=\"v2\"");

  return DispatchScalar(kind, [&](auto tag) {
    using T = CudaScalarT<decltype(tag)::value>;
    return cuda::DispatchHeadSize(p.head_size, [&](auto head) {
      const cudaError_t err =
          cuda::grouped::LaunchGroupedAttention<T, decltype(head)::value>(p, device, stream);
      return err == cudaSuccess ? ffi::Error::Success() : CudaError(op, err);
    });
  });
}

}  // namespace
}  // namespace jax_paged

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedAttentionGroupedCuda, jax_paged::PagedAttentionGroupedCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // query
                                  .Arg<xla::ffi::AnyBuffer>()  // key_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // value_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // block_tables
                                  .Arg<xla::ffi::AnyBuffer>()  // seq_lens
                                  .Arg<xla::ffi::AnyBuffer>()  // alibi_slopes
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("partition_size")
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>()   // exp_sums
                                  .Ret<xla::ffi::AnyBuffer>()   // max_logits
                                  .Ret<xla::ffi::AnyBuffer>(),  // tmp_out
                              {xla::ffi::Traits::kCmdBufferCompatible});
