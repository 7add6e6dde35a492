// Host-side declarations of the CUDA launchers, the supported compile-time
// sizes, and the shared-memory arithmetic. Framework-free.
//
// The launcher templates are DECLARED here and DEFINED in
// paged_attention.cuh / cache_ops.cuh; every (dtype, head size, block size)
// combination is explicitly instantiated in one of the instances/attn_*.cu
// translation units, so that the handler TU compiles no kernels and the
// expensive kernel instantiations build in parallel.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "cuda/options.h"
#include "params.h"
#include "sizes.h"

// The supported compile-time sizes (JAX_PAGED_HEAD_SIZES, ...): sizes.h.

namespace jax_paged {
namespace cuda {

// Query / output "type" of the fp8-cache kernels: the dtype is read at run
// time from PagedAttentionParams::query_kind (float32, float16 or bfloat16).
struct RuntimeFloat {};

constexpr int kAttnThreads = 128;  // 4 warps per CTA
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kMaxGridYZ = 65535;  // CUDA limit on gridDim.y / gridDim.z

// Dynamic shared memory of one attention CTA (the kernel has no static
// shared memory): fp32 query [head_size] | reduction scratch [2 * warps] |
// fp32 logits [logit_slots], the logits region also holding the cross-warp
// output reduction [warps * head_size] after the softmax.
// logit_slots: V1 max_blocks_per_seq * block_size, V2 partition_size.
inline size_t PagedAttentionSmemBytes(int head_size, int64_t logit_slots) {
  const int64_t out_reduce = int64_t{kAttnWarps} * head_size;
  const int64_t slots = logit_slots > out_reduce ? logit_slots : out_reduce;
  return static_cast<size_t>(head_size + 2 * kAttnWarps + slots) * sizeof(float);
}

constexpr int kMaxDevices = 64;

// Device attribute `kAttr` of `device`, queried once per (attribute, device)
// and cached, zero values included (0 if the query fails; not cached then).
template <cudaDeviceAttr kAttr>
inline int CachedDeviceAttribute(int device) {
  static std::atomic<int> cache[kMaxDevices] = {};  // value + 1; 0: not queried yet
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached - 1;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, kAttr, device) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the non-sticky error
    return 0;
  }
  if (device >= 0 && device < kMaxDevices && value >= 0)
    cache[device].store(value + 1, std::memory_order_relaxed);
  return value;
}

inline int MaxSharedMemoryOptin(int device) {
  return CachedDeviceAttribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device);
}

inline int ComputeCapabilityMajor(int device) {
  return CachedDeviceAttribute<cudaDevAttrComputeCapabilityMajor>(device);
}
inline int ComputeCapabilityMinor(int device) {
  return CachedDeviceAttribute<cudaDevAttrComputeCapabilityMinor>(device);
}

// Whether the V2 reduce is launched as a programmatic dependent of the
// attention kernel (PDL, sm_90+; it then starts while that kernel drains).
// KernelOptions::pdl turns it off.
inline bool UseProgrammaticLaunch(int device) {
  return GetKernelOptions().pdl && ComputeCapabilityMajor(device) >= 9;
}

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...), as a
// programmatic dependent launch when `pdl`. Returns the launch status.
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                         cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = pdl ? attr : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// V1 (v2 == false): grid (num_heads * q_len, num_seqs), writes p.out.
// V2 (v2 == true): grid (num_heads * q_len, num_seqs, max_num_partitions)
// writing the workspace, then the reduce kernel, grid (num_heads * q_len,
// num_seqs), writing p.out. T: query/out storage type (RuntimeFloat for fp8
// caches), TC: cache storage type.
// `smem_bytes` = PagedAttentionSmemBytes(...), already checked against the
// device's opt-in limit; `device` is the current device. Returns the launch
// status (cudaGetLastError()).
template <typename T, typename TC, int HEAD_SIZE, int BLOCK_SIZE>
cudaError_t LaunchPagedAttention(const PagedAttentionParams& p, bool v2, size_t smem_bytes,
                                 int device, cudaStream_t stream);

// Keys/values of TIN into caches of TC: TIN itself, or an fp8 type
// (quantised write, value / scale).
template <typename TIN, typename TC>
cudaError_t LaunchReshapeAndCache(const ReshapeAndCacheParams& p, cudaStream_t stream);

// elem_size: bytes of one cache element (1, 2 or 4).
cudaError_t LaunchCopyBlocks(const CopyBlocksParams& p, int elem_size, cudaStream_t stream);

}  // namespace cuda
}  // namespace jax_paged
