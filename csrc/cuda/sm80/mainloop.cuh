// The mainloop of the portable grouped kernel (sm_80 and newer): per tile, each
// warp computes S = Q K^T of its 16-token slice for the CTA's 16 query rows with
// mma.sync m16n8k16, the online softmax on the accumulator fragments (log2
// domain, fp32), and O += P V over its half of the head dims, P rounded to the
// product type. Framework-free.
//
// Fragments (lane = 4 gid + tq): A rows gid and gid + 8; S columns, B columns and
// O dims 2 tq, 2 tq + 1 of each 8-wide n-tile.
//   * 16-bit caches: ldmatrix of K rows (tokens) and V rows (dims) of a stage;
//     the k index of the P.V product is the slice's token.
//   * fp8 caches (f16 products; each value widened exactly in registers): both
//     products sum over an index the kernel may permute. Within each 16-dim
//     chunk lane tq loads one 32-bit word, dims 4 tq .. 4 tq + 3, as the k
//     indices 2 tq, 2 tq + 1, 2 tq + 8, 2 tq + 9, and the query fragments are
//     loaded with the same permutation; S's columns (tokens) are permuted alike
//     (n-tile 0 column c is token 4 (c / 2) + c % 2, n-tile 1 that plus 2), so
//     that P's k indices 2 tq, 2 tq + 1, 2 tq + 8, 2 tq + 9 are the consecutive
//     tokens 4 tq .. 4 tq + 3, one 32-bit word of a V row.
// Tokens no row attends (past the range, invalid pages) have logit -inf and
// their V is zeroed in registers (a stage may hold stale or NaN data there).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "cuda/sm80/config.h"
#include "cuda/sm80/ptx.cuh"
#include "cuda/sm80/variant.cuh"
#include "params.h"

namespace jax_paged {
namespace cuda {
namespace sm80 {

#if JAX_PAGED_SM80_DEVICE

// The CTA's 16 query rows as A fragments of the Q.K products (every warp holds
// all of them), in the product type TM: the query's, or f16 for fp8 caches.
template <typename T, typename TC, int D>
struct QueryFragments {
  using C = PortableConfig<static_cast<int>(sizeof(TC)), D>;
  uint32_t a[C::kKSteps][4];
  uint32_t tail[2];  // the last 8 dims when D = 8 mod 16 (16-bit caches only)

  // Loads rows gid, gid + 8 (zero past w.rows) straight from global memory and
  // returns the scale the product's query carries (a power of two; 1 unless a
  // bf16 query meets fp8 caches).
  __device__ __forceinline__ float Load(const PagedAttentionParams& p, const CtaWork& w, int gid,
                                        int tq) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int lr = gid + 8 * h;
      const bool ok = lr < w.rows;
      const T* row = static_cast<const T*>(p.query) + (ok ? w.HeadRow(p, lr) : 0) * D;
      if constexpr (C::kFp8) {
        // k indices 2 tq, + 1 and 2 tq + 8, + 9 hold dims 16 ks + 4 tq .. + 3.
        const uint2* src = reinterpret_cast<const uint2*>(row) + tq;
#pragma unroll
        for (int ks = 0; ks < C::kKSteps; ++ks) {
          const uint2 v = ok ? src[4 * ks] : make_uint2(0u, 0u);
          a[ks][h] = v.x;
          a[ks][h + 2] = v.y;
        }
      } else {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(row) + tq;
#pragma unroll
        for (int ks = 0; ks < C::kKSteps; ++ks) {
          a[ks][h] = ok ? src[8 * ks] : 0u;
          a[ks][h + 2] = ok ? src[8 * ks + 4] : 0u;
        }
        if constexpr (C::kKTail) tail[h] = ok ? src[8 * C::kKSteps] : 0u;
      }
    }
    float q_scale = 1.0f;
    if constexpr (C::kFp8 && std::is_same_v<T, __nv_bfloat16>) {
      // The warp holds all 16 rows: its maximum is the CTA's.
      float amax = 0.0f;
#pragma unroll
      for (int ks = 0; ks < C::kKSteps; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) amax = fmaxf(amax, Bf16PairAbsMax(a[ks][i]));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      q_scale = F16QueryScale(amax);
#pragma unroll
      for (int ks = 0; ks < C::kKSteps; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[ks][i] = Bf16PairToF16(a[ks][i], q_scale);
    }
    return q_scale;
  }
};

// A warp's running softmax state and output: rows gid (r = 0) and gid + 8 (r = 1),
// its kNTilesPerWarp n-tiles of 8 dims.
template <int D>
struct WarpAccumulator {
  static constexpr int kN = (D / 8 + 1) / 2;
  float o[kN][4];
  float m[2];  // running max (log2 units); -FLT_MAX before any attended token
  float l[2];  // this lane's share of the running sum (the quad's four add up)

  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[r] = -FLT_MAX;
      l[r] = 0.0f;
    }
  }
};

// One warp's work on one tile: its slice's logits, softmax update and P.V.
template <typename T, typename TC, int D>
struct SliceCompute {
  using C = PortableConfig<static_cast<int>(sizeof(TC)), D>;
  using TM = std::conditional_t<C::kFp8, __half, T>;  // product type

  int slice, n0, gid, tq, lane;  // n0: the warp's first n-tile

  // Token (within the slice) of S n-tile j, column 2 tq + e: the k index
  // 2 tq + 8 j + e of P.V.
  __device__ __forceinline__ int TokenOf(int j, int e) const {
    return C::kFp8 ? 4 * tq + 2 * j + e : 8 * j + 2 * tq + e;
  }

  // S = Q K^T for the slice's 16 tokens: s[j] is n-tile j's accumulator.
  __device__ __forceinline__ void QK(const QueryFragments<T, TC, D>& q, uint32_t kbase,
                                     float (&s)[2][4]) const {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.0f;
    if constexpr (C::kFp8) {
      // Rows (tokens) of n-tile 0's column gid and n-tile 1's (see the header).
      const int tok = 4 * (gid >> 1) + (gid & 1);
      const uint32_t row0 = kbase + tok * C::kKRowBytes + 4 * tq;
      const uint32_t row1 = row0 + 2 * C::kKRowBytes;
#pragma unroll
      for (int ks = 0; ks < C::kKSteps; ++ks) {
        uint32_t w0, w1, b0, b1;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w0) : "r"(row0 + 16 * ks));
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w1) : "r"(row1 + 16 * ks));
        Fp8x4ToHalf2x2<TC>(w0, b0, b1);
        Mma16816<TM>(s[0], q.a[ks], b0, b1);
        Fp8x4ToHalf2x2<TC>(w1, b0, b1);
        Mma16816<TM>(s[1], q.a[ks], b0, b1);
      }
    } else {
      // ldmatrix.x4: lanes 8 mi .. 8 mi + 7 address matrix mi = (tokens 8 (mi / 2)..,
      // dims 8 (mi % 2)..): n-tile 0's b0, b1, then n-tile 1's.
      const int row = (lane & 7) + ((lane >> 4) << 3);
      const uint32_t addr = kbase + row * C::kKRowBytes + ((lane >> 3) & 1) * 16;
#pragma unroll
      for (int ks = 0; ks < C::kKSteps; ++ks) {
        uint32_t b[4];
        Ldsm4(b, addr + 32 * ks);
        Mma16816<TM>(s[0], q.a[ks], b[0], b[1]);
        Mma16816<TM>(s[1], q.a[ks], b[2], b[3]);
      }
      if constexpr (C::kKTail) {
        // ldmatrix.x2 (lanes 0-15): tokens 0-7 then 8-15, the last 8 dims.
        const int trow = (lane & 7) + ((lane >> 3) & 1) * 8;
        uint32_t b[2];
        Ldsm2(b, kbase + trow * C::kKRowBytes + 32 * C::kKSteps);
        Mma1688<TM>(s[0], q.tail, b[0]);
        Mma1688<TM>(s[1], q.tail, b[1]);
      }
    }
  }

  // Online softmax over the slice: s (accumulators) -> P as the A fragment of
  // P.V (pa), the running max / sum / output of `acc` rescaled. `bits`: the
  // slice's token-valid bits; `tok0`: the slice's first token.
  __device__ __forceinline__ void Softmax(const AttentionVariant& var, const float (&s)[2][4],
                                          uint32_t bits, int tok0, WarpAccumulator<D>& acc,
                                          uint32_t (&pa)[4]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float x[2][2];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int k = TokenOf(j, e);
          const int t = tok0 + k;
          const bool ok = ((bits >> k) & 1u) != 0u && var.Attends(t, r);
          x[j][e] = ok ? var.Logit(s[j][2 * r + e], t, r) : -INFINITY;
          mx = fmaxf(mx, x[j][e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(acc.m[r], mx);  // -FLT_MAX while nothing is attended
      const float alpha = exp2f(acc.m[r] - m_new);
      acc.m[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float p0 = exp2f(x[j][0] - m_new);
        const float p1 = exp2f(x[j][1] - m_new);
        sum += p0 + p1;
        pa[2 * j + r] = PackPair<TM>(p0, p1);
      }
      acc.l[r] = fmaf(acc.l[r], alpha, sum);
#pragma unroll
      for (int n = 0; n < WarpAccumulator<D>::kN; ++n) {
        acc.o[n][2 * r] *= alpha;
        acc.o[n][2 * r + 1] *= alpha;
      }
    }
  }

  // O += P V over the warp's n-tiles; `vbase`: the stage's V rows, `bits` as above.
  __device__ __forceinline__ void PV(const uint32_t (&pa)[4], uint32_t vbase, uint32_t bits,
                                     WarpAccumulator<D>& acc) const {
    constexpr int kN = WarpAccumulator<D>::kN;
    if constexpr (C::kFp8) {
      const uint32_t vmask = ByteMask((bits >> (4 * tq)) & 0xFu);
      const uint32_t addr = vbase + (8 * n0 + gid) * C::kVRowBytes + slice * 16 + 4 * tq;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        uint32_t w, b0, b1;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w) : "r"(addr + 8 * n * C::kVRowBytes));
        Fp8x4ToHalf2x2<TC>(w & vmask, b0, b1);
        Mma16816<TM>(acc.o[n], pa, b0, b1);
      }
    } else {
      const uint32_t m0 = HalfMask((bits >> (2 * tq)) & 3u);
      const uint32_t m1 = HalfMask((bits >> (8 + 2 * tq)) & 3u);
      // ldmatrix.x4: matrix mi = (dims 8 (n + mi / 2).., tokens 8 (mi % 2)..): b0, b1
      // of n-tile n, then of n + 1; .x2 (lanes 0-15): n-tile n alone.
      const int drow = (lane & 7) + ((lane >> 4) << 3);
      const uint32_t addr =
          vbase + (8 * n0 + drow) * C::kVRowBytes + (slice * 16 + ((lane >> 3) & 1) * 8) * 2;
      const uint32_t addr2 =
          vbase + (8 * n0 + (lane & 7)) * C::kVRowBytes + (slice * 16 + ((lane >> 3) & 1) * 8) * 2;
#pragma unroll
      for (int n = 0; n < kN; n += 2) {
        const bool pair = n + 1 < kN && (C::kNTiles % 2 == 0 || n0 + n + 1 < C::kNTiles);
        if (pair) {
          uint32_t b[4];
          Ldsm4(b, addr + 8 * n * C::kVRowBytes);
          Mma16816<TM>(acc.o[n], pa, b[0] & m0, b[1] & m1);
          Mma16816<TM>(acc.o[n + 1], pa, b[2] & m0, b[3] & m1);
        } else if (n0 + n < C::kNTiles) {
          uint32_t b[2];
          Ldsm2(b, addr2 + 8 * n * C::kVRowBytes);
          Mma16816<TM>(acc.o[n], pa, b[0] & m0, b[1] & m1);
        }
      }
    }
  }
};

#endif  // JAX_PAGED_SM80_DEVICE

}  // namespace sm80
}  // namespace cuda
}  // namespace jax_paged
