// XLA FFI handler of the split-KV, GQA-grouped decode kernel
// (jax_paged_attention_grouped): the extended V2 contract (operands,
// attributes and results, workspace and lse included; see
// BindAttentionOperands), a different kernel: the Hopper form
// (cuda/grouped_attention.cuh) on compute capability 9.x, the portable one
// (cuda/sm80/) on 8.x and on newer GPUs. Unpack + check (common.h), dtype
// dispatch (fp8 caches with f16/bf16 queries), head-size dispatch
// (cuda_dispatch.cuh); no allocation, no host synchronisation (command-buffer
// compatible). Compiles no kernel: the launchers are instantiated in
// cuda/instances/.
#include <cuda_runtime.h>

#include "ffi/xla_ffi.h"

#include <atomic>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/dtypes.cuh"
#include "cuda/grouped_launch.h"
#include "cuda/launch.h"
#include "cuda/options.h"
#include "cuda/sm80/launch.h"
#include "ffi/common.h"
#include "ffi/cuda_dispatch.cuh"
#include "ffi/handlers.h"

namespace jax_paged {
namespace cuda {
namespace grouped {

template <typename C>
GroupedKernelInfo InfoFromConfig() {
  GroupedKernelInfo info;
  info.smem_bytes = C::kSmemBytes;
  info.ctas_per_sm = C::kCtasPerSm;
  info.rows_per_cta = C::kRows;
  return info;
}

// The configuration SelectGroupedKernel (grouped_attention.cuh) picks (WithGroupedLayout).
template <int QELEM, int CELEM, int H>
GroupedKernelInfo InfoOf(int rows_per_kv_head, int q_len, int64_t seq_kv_heads) {
  return WithGroupedLayout<QELEM, CELEM, H>(
      q_len, rows_per_kv_head, seq_kv_heads, [](auto row_blocks, auto fp8_ctas) {
        return InfoFromConfig<GroupedConfig<QELEM, CELEM, H, decltype(row_blocks)::value, 1,
                                            decltype(fp8_ctas)::value>>();
      });
}

GroupedKernelInfo GroupedInfo(ScalarKind query_kind, CacheKind cache_kind, int head_size,
                              int rows_per_kv_head, int q_len, int64_t seq_kv_heads) {
  GroupedKernelInfo info;
#define JAX_PAGED_GROUPED_INFO_(QELEM, CELEM, H) \
  if (head_size == H) info = InfoOf<QELEM, CELEM, H>(rows_per_kv_head, q_len, seq_kv_heads);
  if (cache_kind != CacheKind::kSameAsQuery) {
    if (query_kind == ScalarKind::kF32) return info;  // fp8 caches need a 16-bit query
    JAX_PAGED_FP8_HEAD_SIZES_A(JAX_PAGED_GROUPED_INFO_, 2, 1)
    JAX_PAGED_FP8_HEAD_SIZES_B(JAX_PAGED_GROUPED_INFO_, 2, 1)
  } else if (query_kind == ScalarKind::kF32) {
    JAX_PAGED_HEAD_SIZES(JAX_PAGED_GROUPED_INFO_, 4, 4)
  } else {
    JAX_PAGED_HEAD_SIZES(JAX_PAGED_GROUPED_INFO_, 2, 2)
  }
#undef JAX_PAGED_GROUPED_INFO_
  return info;
}

// Whether impl="grouped" runs the portable kernel on `device`: every GPU but
// compute capability 9.x (the Hopper form's bulk copies and its sm_90a machine
// code), or any GPU under the development option `portable`.
bool UsePortable(int device) {
  const int major = ComputeCapabilityMajor(device);
  return GetKernelOptions().portable || major != 9;
}

// The portable kernel's CTAs per SM (shared memory and its launch bounds) and rows.
GroupedKernelInfo PortableInfo(CacheKind cache_kind, int head_size, int device) {
  GroupedKernelInfo info;
  const int cache_elem = cache_kind == CacheKind::kSameAsQuery ? 2 : 1;
  info.smem_bytes = sm80::PortableSmemBytes(cache_elem, head_size);
  if (info.smem_bytes == 0) return info;
  int min_blocks = 0;
  DispatchHeadSize(head_size, [&](auto head) {
    constexpr int D = decltype(head)::value;
    if constexpr (D % 16 == 0)
      min_blocks = cache_elem == 1 ? sm80::PortableConfig<1, D>::kMinBlocks
                                   : sm80::PortableConfig<2, D>::kMinBlocks;
    else
      min_blocks = sm80::PortableConfig<2, D>::kMinBlocks;
    return ffi::Error::Success();
  });
  int smem_per_sm =
      CachedDeviceAttribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(device);
  if (smem_per_sm <= 0) smem_per_sm = 100 * 1024;  // the least of sm_86 / sm_89
  info.ctas_per_sm = sm80::PortableCtasPerSm(static_cast<int>(info.smem_bytes), smem_per_sm,
                                             min_blocks);
  info.rows_per_cta = sm80::kPortableRowsPerCta;
  return info;
}

}  // namespace grouped
}  // namespace cuda

namespace {

using cuda::CudaError;

#ifdef JAX_PAGED_TRACE
// Development builds: the trace buffer every grouped launch writes into
// (set from Python, dev/trace_case.py; 0 = none).
std::atomic<unsigned long long*> g_trace{nullptr};
std::atomic<int> g_trace_capacity{0};
#endif

ffi::Error RunGroupedAttention(cudaStream_t stream, PagedAttentionParams& p, ScalarKind kind) {
  constexpr const char* op = "paged_attention_grouped";
#ifdef JAX_PAGED_TRACE
  p.trace = g_trace.load();
  p.trace_capacity = g_trace_capacity.load();
#endif
  if (!cuda::IsSupportedHeadSize(p.head_size)) return cuda::UnsupportedHeadSize(p.head_size);
  if (!cuda::IsSupportedBlockSize(p.block_size)) return cuda::UnsupportedBlockSize(p.block_size);
  const bool fp8 = p.cache_kind != CacheKind::kSameAsQuery;
  if (fp8 && kind == ScalarKind::kF32)
    return ArgError(std::string(op) + ": fp8 caches need a float16 or bfloat16 query here, got "
                    "float32; use impl=\"v2\"");
  if (fp8 && p.head_size % 16 != 0)
    return ArgError(std::string(op) + ": fp8 caches need head_size % 16 == 0, got " +
                    std::to_string(p.head_size));
  if (p.num_seqs == 0 || p.num_heads == 0) return ffi::Error::Success();  // nothing to write
  if (auto err = cuda::CheckAttentionLaunch(p, op, /*partitioned=*/true); err.failure()) return err;

  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return CudaError(op, err);
  const int major = cuda::ComputeCapabilityMajor(device);
  if (major > 0 && major < 8)
    return ArgError(std::string(op) + ": the grouped kernel needs compute capability 8.0 "
                    "(Ampere) or newer; use impl=\"v2\" on this GPU");
  const bool portable = cuda::grouped::UsePortable(device);
  if (portable && kind == ScalarKind::kF32)
    return ArgError(std::string(op) + ": a float32 query needs compute capability 9.x here; "
                    "use impl=\"v2\" on this GPU");
  const size_t smem =
      portable
          ? cuda::grouped::PortableInfo(p.cache_kind, p.head_size, device).smem_bytes
          : cuda::grouped::GroupedInfo(kind, p.cache_kind, p.head_size,
                                       cuda::grouped::RowsPerKvHead(p), p.q_len,
                                       int64_t{p.num_seqs} * p.num_kv_heads)
                .smem_bytes;
  const int optin = cuda::MaxSharedMemoryOptin(device);
  if (optin > 0 && smem > static_cast<size_t>(optin))
    return ArgError(std::string(op) + ": needs " + std::to_string(smem) +
                    " bytes of shared memory per block, more than this GPU's " +
                    std::to_string(optin) + "; use impl=\"v2\"");

  return cuda::DispatchQueryAndCache(kind, p.cache_kind, [&](auto query_type,
                                                             auto cache_type) -> ffi::Error {
    using T = decltype(query_type);
    using TC = decltype(cache_type);
    if constexpr (sizeof(TC) == 1 && std::is_same_v<T, float>) {
      return ffi::Error::Internal("unreachable: fp8 with a float32 query checked above");
    } else {
      return cuda::DispatchHeadSize(p.head_size, [&](auto head) -> ffi::Error {
        constexpr int kHead = decltype(head)::value;
        if constexpr (sizeof(TC) == 1 && kHead % 16 != 0) {
          return ffi::Error::Internal("unreachable: fp8 head size checked above");
        } else {
          cudaError_t err;
          if constexpr (std::is_same_v<T, float>) {
            err = cuda::grouped::LaunchGroupedAttention<T, TC, kHead>(p, device, stream);
          } else {
            err = portable ? cuda::sm80::LaunchPortableGroupedAttention<T, TC, kHead>(p, device,
                                                                                     stream)
                           : cuda::grouped::LaunchGroupedAttention<T, TC, kHead>(p, device,
                                                                                stream);
          }
          return err == cudaSuccess ? ffi::Error::Success() : CudaError(op, err);
        }
      });
    }
  });
}

}  // namespace
}  // namespace jax_paged

#ifdef JAX_PAGED_TRACE
void JaxPagedSetGroupedTrace(uintptr_t buffer, int capacity_ctas) {
  jax_paged::g_trace.store(reinterpret_cast<unsigned long long*>(buffer));
  jax_paged::g_trace_capacity.store(buffer != 0 ? capacity_ctas : 0);
}
#endif

namespace {
jax_paged::cuda::grouped::GroupedKernelInfo InfoForItemsizes(int query_itemsize,
                                                            int cache_itemsize, int head_size,
                                                            int rows_per_kv_head, int q_len,
                                                            int64_t seq_kv_heads) {
  using jax_paged::CacheKind;
  using jax_paged::ScalarKind;
  const ScalarKind query_kind = query_itemsize == 4 ? ScalarKind::kF32 : ScalarKind::kBF16;
  const CacheKind cache_kind = cache_itemsize == 1 ? CacheKind::kFp8E4M3 : CacheKind::kSameAsQuery;
  return jax_paged::cuda::grouped::GroupedInfo(query_kind, cache_kind, head_size,
                                               rows_per_kv_head, q_len, seq_kv_heads);
}
}  // namespace

namespace {
// The layout of the kernel impl="grouped" runs on the current device: the partition
// rule (jax_paged/primitives.py) sizes its split with it.
jax_paged::cuda::grouped::GroupedKernelInfo CurrentDeviceInfo(int query_itemsize,
                                                              int cache_itemsize, int head_size,
                                                              int rows_per_kv_head, int q_len,
                                                              int64_t seq_kv_heads) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    device = -1;
  }
  if (device >= 0 && query_itemsize == 2 && jax_paged::cuda::grouped::UsePortable(device)) {
    return jax_paged::cuda::grouped::PortableInfo(
        cache_itemsize == 1 ? jax_paged::CacheKind::kFp8E4M3 : jax_paged::CacheKind::kSameAsQuery,
        head_size, device);
  }
  return InfoForItemsizes(query_itemsize, cache_itemsize, head_size, rows_per_kv_head, q_len,
                          seq_kv_heads);
}
}  // namespace

int JaxPagedGroupedCtasPerSm(int query_itemsize, int cache_itemsize, int head_size,
                             int rows_per_kv_head, int q_len, int64_t seq_kv_heads) {
  return CurrentDeviceInfo(query_itemsize, cache_itemsize, head_size, rows_per_kv_head, q_len,
                           seq_kv_heads)
      .ctas_per_sm;
}

int JaxPagedGroupedRowsPerCta(int query_itemsize, int cache_itemsize, int head_size,
                              int rows_per_kv_head, int q_len, int64_t seq_kv_heads) {
  return CurrentDeviceInfo(query_itemsize, cache_itemsize, head_size, rows_per_kv_head, q_len,
                           seq_kv_heads)
      .rows_per_cta;
}

const char* JaxPagedDevelopmentOptions() {
  return ""
#ifdef JAX_PAGED_TRACE
         "TRACE "
#endif
#ifdef JAX_PAGED_PROBE_NO_COMPUTE
         "PROBE_NO_COMPUTE "
#endif
#ifdef JAX_PAGED_PROBE_NO_REDUCE
         "PROBE_NO_REDUCE "
#endif
#ifdef JAX_PAGED_PROBE_NO_LOADS
         "PROBE_NO_LOADS "
#endif
      ;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedAttentionGroupedCuda,
                              jax_paged::cuda::PartitionedAttention<jax_paged::RunGroupedAttention>,
                              jax_paged::PartitionedAttentionBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
