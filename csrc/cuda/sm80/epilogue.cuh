// The epilogue of the portable grouped kernel: merges the two token slices of
// each row exactly (rescaled to their common max), normalises, and writes either
// the V2 workspace of the CTA's partition (max_logits, exp_sums, tmp_out, which
// V2's reduce kernel merges) or, with a single partition, `out` and `lse`
// directly (the reduce of one partition folded in). Framework-free.
//
// Per row, partition values as in paged_attention.cuh's V2 contract:
//   m = max logit (natural units; -FLT_MAX if none), s = sum exp(l_t - m),
//   tmp_out = v_scale * sum exp(l_t - m) v_t / (s + 1e-6);
//   single partition: out = tmp_out * s / (s + 1e-6), lse = m + log(s + 1e-6)
//   (-inf when s == 0).
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "cuda/paged_attention.cuh"  // LogSumExp
#include "cuda/sm80/config.h"
#include "cuda/sm80/mainloop.cuh"
#include "cuda/sm80/ptx.cuh"
#include "cuda/sm80/variant.cuh"
#include "params.h"

namespace jax_paged {
namespace cuda {
namespace sm80 {

#if JAX_PAGED_SM80_DEVICE

// A CTA whose partition holds no attended token: the well-defined empty result
// (zeros, m = -FLT_MAX, s = 0; out = 0 and lse = -inf with a single partition).
template <typename T, int D>
__device__ void WriteEmpty(const PagedAttentionParams& p, const CtaWork& w, bool direct_out) {
  const int P = p.max_num_partitions;
  for (int i = threadIdx.x; i < w.rows * D; i += kThreads) {
    const int r = i / D;
    const int d = i - r * D;
    const int64_t hrow = w.HeadRow(p, r);
    if (direct_out) {
      static_cast<T*>(p.out)[hrow * D + d] = FromFloat<T>(0.0f);
      if (d == 0 && p.lse != nullptr) p.lse[hrow] = -INFINITY;
    } else {
      p.tmp_out[(hrow * P + w.part) * D + d] = 0.0f;
      if (d == 0) {
        p.max_logits[hrow * P + w.part] = -FLT_MAX;
        p.exp_sums[hrow * P + w.part] = 0.0f;
      }
    }
  }
}

// Merge, normalise, write. Called by every thread after the mainloop, with no
// copy in flight and every warp done reading the stages (the merge buffer
// overlays them). slice, dh: the warp's token slice and dim half.
template <typename T, int CELEM, int D>
__device__ __forceinline__ void Epilogue(const PagedAttentionParams& p, const CtaWork& w,
                                         bool direct_out, float v_scale, WarpAccumulator<D>& acc,
                                         unsigned char* smem, int slice, int dh, int gid, int tq) {
  using C = PortableConfig<CELEM, D>;
  constexpr int kN = WarpAccumulator<D>::kN;
  const int n0 = dh * kN;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    acc.l[r] += __shfl_xor_sync(0xffffffffu, acc.l[r], 1);
    acc.l[r] += __shfl_xor_sync(0xffffffffu, acc.l[r], 2);
  }
  float* ml_s = reinterpret_cast<float*>(smem + C::kMlOff);  // [kSlices][kRows][2]
  if (dh == 0 && tq == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      ml_s[(slice * kRows + gid + 8 * r) * 2] = acc.m[r];
      ml_s[(slice * kRows + gid + 8 * r) * 2 + 1] = acc.l[r];
    }
  }
  __syncthreads();
  float row_m[2], row_l[2], f[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = gid + 8 * r;
    const float m0 = ml_s[row * 2], l0 = ml_s[row * 2 + 1];
    const float m1 = ml_s[(kRows + row) * 2], l1 = ml_s[(kRows + row) * 2 + 1];
    row_m[r] = fmaxf(m0, m1);
    row_l[r] = l0 * exp2f(m0 - row_m[r]) + l1 * exp2f(m1 - row_m[r]);
    f[r] = exp2f(acc.m[r] - row_m[r]);
  }
  float* obuf = reinterpret_cast<float*>(smem);  // [kRows][kObufStride]
  if (slice == 1) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int n = 0; n < kN; ++n)
        if (n0 + n < C::kNTiles)
          *reinterpret_cast<float2*>(obuf + (gid + 8 * r) * C::kObufStride + 8 * (n0 + n) + 2 * tq) =
              make_float2(acc.o[n][2 * r] * f[r], acc.o[n][2 * r + 1] * f[r]);
  }
  __syncthreads();
  if (slice != 0) return;
  const int P = p.max_num_partitions;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = gid + 8 * r;
    if (row >= w.rows) continue;
    const float l = row_l[r];
    const float factor = v_scale / (l + 1e-6f);
    const float weight = direct_out ? l / (l + 1e-6f) : 1.0f;  // V2's reduce of one partition
    const int64_t hrow = w.HeadRow(p, row);
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      if (n0 + n >= C::kNTiles) continue;
      const int d = 8 * (n0 + n) + 2 * tq;
      const float2 other = *reinterpret_cast<const float2*>(obuf + row * C::kObufStride + d);
      const float v0 = (acc.o[n][2 * r] * f[r] + other.x) * factor;
      const float v1 = (acc.o[n][2 * r + 1] * f[r] + other.y) * factor;
      if (direct_out) {
        *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + hrow * D + d) =
            PackPair<T>(v0 * weight, v1 * weight);
      } else {
        *reinterpret_cast<float2*>(p.tmp_out + (hrow * P + w.part) * D + d) = make_float2(v0, v1);
      }
    }
    if (dh == 0 && tq == 0) {
      const float m_nat = row_m[r] == -FLT_MAX ? -FLT_MAX : row_m[r] * kLn2;
      if (direct_out) {
        if (p.lse != nullptr) p.lse[hrow] = LogSumExp(m_nat, l);
      } else {
        p.max_logits[hrow * P + w.part] = m_nat;
        p.exp_sums[hrow * P + w.part] = l;
      }
    }
  }
}

#endif  // JAX_PAGED_SM80_DEVICE

}  // namespace sm80
}  // namespace cuda
}  // namespace jax_paged
