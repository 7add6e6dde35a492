// Host-visible entry point of the portable grouped decode kernel (sm_80 and
// newer; kernel.cuh), instantiated per dtype in instances/sm80_<dtype>.cu.
// Framework-free.
//
// Contract: exactly the Hopper grouped launcher's (grouped_launch.h,
// LaunchGroupedAttention), i.e. paged_attention_v2's with its extensions: fp8
// caches under 16-bit queries with k_scale / v_scale, soft cap, sliding window,
// LSE, multi-token queries, ALiBi; block sizes 8, 16 and 32.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/sm80/config.h"
#include "params.h"

namespace jax_paged {
namespace cuda {
namespace sm80 {

// Partitions in the kernel's grid (its z dimension): the workspace's
// max_num_partitions, or with a sliding window and a split at most the
// partitions one CTA's rows can touch, the kernel counting them from the
// partition of its first row's first token. A CTA's rows span at most
// sliding_window + q_len - 1 tokens, which touch at most
// ceil(span / partition_size) + 1 partitions.
inline int PortableGridPartitions(const PagedAttentionParams& p) {
  const int parts = p.max_num_partitions;
  if (p.sliding_window <= 0 || parts <= 1) return parts;
  const int64_t span = int64_t{p.sliding_window} + p.q_len - 1;
  const int64_t touched = (span + p.partition_size - 1) / p.partition_size + 1;
  return static_cast<int>(std::min<int64_t>(parts, touched));
}

// Dynamic shared memory of one CTA for caches of `cache_elem` bytes (2: the
// query's dtype; 1: fp8) at `head_size`; 0 for a size without an instantiation.
inline size_t PortableSmemBytes(int cache_elem, int head_size) {
  auto bytes = [&](auto d) -> size_t {
    constexpr int D = decltype(d)::value;
    if (cache_elem == 1) {
      if constexpr (D % 16 == 0) return PortableConfig<1, D>::kSmemBytes;
      return 0;
    }
    return PortableConfig<2, D>::kSmemBytes;
  };
  switch (head_size) {
    case 64: return bytes(std::integral_constant<int, 64>{});
    case 80: return bytes(std::integral_constant<int, 80>{});
    case 96: return bytes(std::integral_constant<int, 96>{});
    case 112: return bytes(std::integral_constant<int, 112>{});
    case 120: return bytes(std::integral_constant<int, 120>{});
    case 128: return bytes(std::integral_constant<int, 128>{});
    case 192: return bytes(std::integral_constant<int, 192>{});
    case 256: return bytes(std::integral_constant<int, 256>{});
    default: return 0;
  }
}

// Query rows per CTA (the partition rule's work unit is one CTA's rows).
constexpr int kPortableRowsPerCta = kRows;

// Launches the portable kernel over the V2 workspace of `p` and, when
// p.max_num_partitions > 1, V2's reduce kernel (paged_attention.cuh); with a
// single partition the kernel writes p.out (and p.lse) directly. T: query /
// output type (__half or __nv_bfloat16); TC: cache type (T, __nv_fp8_e4m3 or
// __nv_fp8_e5m2; fp8 needs HEAD_SIZE % 16 == 0). The caller has checked shapes,
// block size (8, 16 or 32), partition_size (a multiple of block_size), 16-byte
// alignment, the device (compute capability 8.0 or newer) and that
// PortableSmemBytes fits its opt-in shared memory. `device` is the current
// device. Returns cudaGetLastError().
template <typename T, typename TC, int HEAD_SIZE>
cudaError_t LaunchPortableGroupedAttention(const PagedAttentionParams& p, int device,
                                           cudaStream_t stream);

}  // namespace sm80
}  // namespace cuda
}  // namespace jax_paged
