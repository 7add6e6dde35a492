// Portable split-KV, GQA-grouped paged-attention decode kernel (sm_80 and newer:
// Ampere, Ada, and Hopper, where it is the fallback form). Framework-free. Same
// contract as the grouped kernel's launcher (grouped_launch.h) and V2
// (paged_attention.cuh): the same workspace, the same per-partition results and
// V2's reduce kernel.
//
// Grid (num_kv_heads * group_chunks, num_seqs chunk, PortableGridPartitions),
// kThreads threads: one CTA per (KV head, sequence, partition) computes up to
// kRows query rows of its KV head (q_len * group rows; more are split over
// group_chunks CTAs), so each K/V page of the partition is read once per 16 rows
// instead of once per query row.
//
// Pipeline: the CTA's pages stream through kStages shared-memory stages of kTile
// tokens, copied with cp.async (loader.cuh) kStages - 1 tiles ahead, one CTA
// barrier per tile; each thread holds the block-table entries of the next tile
// to copy, loaded a tile ahead. Per tile each warp computes its slice
// (mainloop.cuh); the epilogue (epilogue.cuh) merges the slices and writes.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda/launch.h"
#include "cuda/paged_attention.cuh"  // LaunchReduce, EnsureSmemOptin, AllowDependentLaunch
#include "cuda/sm80/config.h"
#include "cuda/sm80/epilogue.cuh"
#include "cuda/sm80/launch.h"
#include "cuda/sm80/loader.cuh"
#include "cuda/sm80/mainloop.cuh"
#include "cuda/sm80/ptx.cuh"
#include "cuda/sm80/variant.cuh"
#include "params.h"

namespace jax_paged {
namespace cuda {
namespace sm80 {

// T: query / output type (__half or __nv_bfloat16); TC: cache type (T, or an fp8
// type). rows_per_cta <= kRows; direct_out: a single partition (write out / lse).
template <typename T, typename TC, int D>
__global__ void __launch_bounds__(kThreads,
                                  (PortableConfig<static_cast<int>(sizeof(TC)), D>::kMinBlocks))
    PortableGroupedKernel(const PagedAttentionParams p, const int seq_base,
                          const int group_chunks, const int rows_per_cta, const bool direct_out) {
#if !JAX_PAGED_SM80_DEVICE
  __trap();
#else
  using C = PortableConfig<static_cast<int>(sizeof(TC)), D>;
  static_assert(sizeof(T) == 2, "16-bit queries");
  static_assert(sizeof(TC) == sizeof(T) ? std::is_same_v<T, TC> : C::kFp8,
                "caches of the query's dtype or fp8");
  constexpr int kStages = C::kStages;
  const CtaWork w = MakeCtaWork(p, seq_base, group_chunks, rows_per_cta, p.block_size);
  if (w.rows <= 0 || w.part >= p.max_num_partitions) return;
  if (w.tok_lo >= w.tok_hi) {
    WriteEmpty<T, D>(p, w, direct_out);
    return;
  }
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int gid = lane >> 2;
  const int tq = lane & 3;
  const int slice = warp / kWarpsPerSlice;
  const int dh = warp % kWarpsPerSlice;

  PageLoader<TC, D> loader;
  loader.Init(p, w, smem, p.block_size);
  const int ntiles = loader.NumTiles();  // >= 1
  int32_t ent[kMaxTilePages];
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) {
      loader.LoadEntries(s, ent);
      loader.Issue(s, s, ent, tid);
    }
    CpAsyncCommit();
  }
  loader.LoadEntries(kStages - 1, ent);
  AllowDependentLaunch();  // the reduce (if any) may be scheduled; it waits for this grid

  QueryFragments<T, TC, D> q;
  const float q_scale = q.Load(p, w, gid, tq);
  const float k_scale = p.k_scale != nullptr ? p.k_scale[w.kv_head * p.k_scale_stride] : 1.0f;
  const float v_scale = p.v_scale != nullptr ? p.v_scale[w.kv_head * p.v_scale_stride] : 1.0f;
  AttentionVariant var;
  var.Init(p, w, p.scale * k_scale / q_scale, gid);
  SliceCompute<T, TC, D> sc;
  sc.slice = slice;
  sc.n0 = dh * WarpAccumulator<D>::kN;
  sc.gid = gid;
  sc.tq = tq;
  sc.lane = lane;
  WarpAccumulator<D> acc;
  acc.Init();

  const uint32_t smem_addr = SmemAddr(smem);
  int stage = 0;
  for (int k = 0; k < ntiles; ++k) {
    CpAsyncWait<kStages - 2>();  // tile k has arrived (this thread's copies)
    __syncthreads();             // ... everyone's; and tile k - 1's stage is free
    const int next = k + kStages - 1;
    const int next_stage = stage == 0 ? kStages - 1 : stage - 1;
    if (next < ntiles) {
      loader.Issue(next, next_stage, ent, tid);
      loader.LoadEntries(next + 1, ent);
    }
    CpAsyncCommit();
    const uint32_t bits = (loader.mask_s[stage] >> (16 * slice)) & 0xFFFFu;
    if (bits != 0u) {  // (warp-uniform)
      const uint32_t kbase = smem_addr + stage * C::kStageBytes + slice * 16 * C::kKRowBytes;
      const uint32_t vbase = smem_addr + stage * C::kStageBytes + C::kKBytes;
      const int tok0 = ((loader.start_blk + k * loader.ppt) << loader.log2_bs) + 16 * slice;
      float s[2][4];
      uint32_t pa[4];
      sc.QK(q, kbase, s);
      sc.Softmax(var, s, bits, tok0, acc, pa);
      sc.PV(pa, vbase, bits, acc);
    }
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
  CpAsyncWait<0>();  // (only empty groups remain; the merge buffer overlays the stages)
  Epilogue<T, static_cast<int>(sizeof(TC)), D>(p, w, direct_out, v_scale, acc, smem, slice, dh,
                                               gid, tq);
#endif
}

// Raises the kernel's shared-memory limit and prefers the largest carveout,
// once per (kernel, device): `smem_configured` and `carveout_set` [kMaxDevices]
// are the kernel's own flags.
template <typename Kernel>
cudaError_t ConfigurePortableKernel(Kernel kernel, size_t smem_bytes, int device,
                                    std::atomic<bool>* smem_configured,
                                    std::atomic<bool>* carveout_set) {
  if (cudaError_t err = EnsureSmemOptin(kernel, smem_bytes, device, smem_configured);
      err != cudaSuccess)
    return err;
  if (device >= 0 && device < kMaxDevices && !carveout_set[device].load(std::memory_order_acquire)) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared) != cudaSuccess)
      (void)cudaGetLastError();  // a hint; failure is harmless
    carveout_set[device].store(true, std::memory_order_release);
  }
  return cudaSuccess;
}

template <typename T, typename TC, int HEAD_SIZE>
cudaError_t LaunchPortableGroupedAttention(const PagedAttentionParams& p, int device,
                                           cudaStream_t stream) {
  using C = PortableConfig<static_cast<int>(sizeof(TC)), HEAD_SIZE>;
  auto kernel = &PortableGroupedKernel<T, TC, HEAD_SIZE>;
  static std::atomic<bool> smem_configured[kMaxDevices];
  static std::atomic<bool> carveout_set[kMaxDevices];
  if (cudaError_t err =
          ConfigurePortableKernel(kernel, C::kSmemBytes, device, smem_configured, carveout_set);
      err != cudaSuccess)
    return err;
  const int rows = (p.num_heads / p.num_kv_heads) * p.q_len;
  const int group_chunks = (rows + kRows - 1) / kRows;
  const int rows_per_cta = (rows + group_chunks - 1) / group_chunks;
  const bool direct_out = p.max_num_partitions == 1;
  const bool pdl = UseProgrammaticLaunch(device);
  for (int base = 0; base < p.num_seqs; base += kMaxGridYZ) {
    const int n = std::min(kMaxGridYZ, p.num_seqs - base);
    kernel<<<dim3(p.num_kv_heads * group_chunks, n, PortableGridPartitions(p)), kThreads,
             C::kSmemBytes, stream>>>(p, base, group_chunks, rows_per_cta, direct_out);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    if (!direct_out) {
      if (cudaError_t err = LaunchReduce<T>(p, base, n, pdl, stream); err != cudaSuccess)
        return err;
    }
  }
  return cudaGetLastError();
}

}  // namespace sm80
}  // namespace cuda
}  // namespace jax_paged

// Explicit instantiation for one query type, cache type and head size
// (instances/sm80_*.cu).
#define JAX_PAGED_INSTANTIATE_SM80(T, TC, H)                                               \
  template cudaError_t jax_paged::cuda::sm80::LaunchPortableGroupedAttention<T, TC, H>(    \
      const jax_paged::PagedAttentionParams&, int, cudaStream_t);
