// Split-KV, GQA-grouped paged-attention decode kernel (impl="grouped").
// Framework-free. Same contract as V2 (see paged_attention.cuh): the same
// workspace, the same per-partition results, and V2's reduce kernel.
//
// One CTA (4 warps) per (KV head, sequence, partition) computes all the query
// rows of its KV head (q_len * group: up to 16, or 32 / 64 with the row split
// below; more are split over num_kv_heads * group_chunks CTAs), so each K/V
// page of the partition is read from HBM once, not once per query head.
//
// Memory pipeline: the partition's pages stream through kStages shared-memory
// stages of kTile tokens (32, 64, or 128 with wide fp8 slices). Per (page, KV
// head) the cache layout puts K ([D/x][BS][x]) and V ([D][BS]) in two
// contiguous runs of D * BS elements, so lane i of one warp copies page i of a
// tile with two bulk copies (cp.async.bulk, plain sm_90; no tensor map)
// completing on the stage's mbarrier. Invalid pages (id outside [0,
// num_blocks)) and pages past the partition's end are never copied; a
// per-stage bit mask says which pages arrived. In the decode kernels each warp
// releases a stage it is done with by counting itself in a shared counter and
// goes on; the warp that completes the count refills the stage (its lanes
// issue the copies of the tile kStages on), so no warp waits for another. (The
// row split instead meets at a CTA barrier per tile, after which warp 0
// refills.) The table entries of each refill are loaded one refill ahead into
// shared memory.
//
// Compute, per tile: warp w takes a 16-token slice (two warps per slice when
// D >= 192 with 16-bit caches, each doing half of the P.V dims). Rows are
// query heads (16, zero padded), columns tokens:
//   * f16/bf16: S = Q K^T with mma.m16n8k16 (ldmatrix of Q and of K straight
//     from the cache layout: a 16-byte K chunk is one ldmatrix row), online
//     softmax on the accumulator fragments (log2 domain, fp32), P rounded to
//     the query dtype as the A operand of O += P V (ldmatrix of V rows, whose
//     BS tokens are contiguous), the softmax sum over the unrounded P. fp32
//     accumulation. fp8 caches: the same in f16 (see below).
//   * f32: the same fragment layout computed with fp32 FMAs (CUDA cores).
// Row split (multi-token queries with 16-bit queries, every cache dtype and head
// size; see RowBlocks in grouped_launch.h): a KV head with more than 16 query rows takes CTAs of 32 or 64 rows
// instead of 16 (two or four row blocks), the warps split over row blocks and,
// with two, over pairs of slices; each warp holds its 16 query rows in
// registers and computes all its slices of a tile in one pass (independent
// accumulator chains; one max shuffle and O rescale per tile); V's ldmatrix rows
// are swizzled against bank conflicts; a pass wholly inside every row's range
// skips the per-token tests, and a wholly valid tile skips the per-token mask;
// a row's running maximum is raised only when a pass exceeds it by more than
// 2^8 (lazy rescale, exact); one kernel per block size; each page is copied
// once per 32 or 64 rows.
// On compute capability 9.0 the 64-row CTAs of 16-bit caches at head sizes
// 80-128 take their wgmma form (kWgmma, sm_90a code; KernelOptions::wgmma):
// Q.K and P.V as warpgroup products (wgmma.cuh) reading K and V from the
// stages in place (V's pages copied through a tensor map, v_map, that
// swizzles them into P.V's operand layout), tile k + 1's Q.K overlapping tile
// k's softmax, its query rows loaded from global memory straight into the A
// fragments and its output written from the accumulators (no staging, no merge
// buffer). A KV head of more than 64 rows (kWarpgroups; KernelOptions::wgmma_128)
// takes CTAs of 128 rows in two warpgroups over shared stages, so that it copies
// each page once.
// Masked tokens (t >= L, invalid page, past the partition) get logit -inf;
// their V is zeroed in registers (0 * NaN = NaN), their K never matters.
// Each warp keeps its own running max / sum / output over its slices; the
// slices are merged exactly at the end of the partition through shared
// memory. With one partition (max_num_partitions == 1) the kernel writes
// `out` itself (the V2 reduce of a single partition, folded in); otherwise it
// writes the workspace and V2's reduce kernel runs after it.
#pragma once

#include <cuda.h>  // CUtensorMap (the wgmma form's V copies; no driver call is linked)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "cuda/dtypes.cuh"
#include "cuda/grouped_launch.h"
#include "cuda/launch.h"
#include "cuda/options.h"
#include "cuda/paged_attention.cuh"  // PagedAttentionReduceKernel, EnsureSmemOptin
#include "cuda/sm80/ptx.cuh"          // Ldsm4, Mma16816, ...
#include "params.h"
#include "cuda/wgmma.cuh"

namespace jax_paged {
namespace cuda {
namespace grouped {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLazyRescale = 8.0f;  // the row split's lazy rescale threshold (log2 units)

// ---- PTX wrappers ------------------------------------------------------------
// sm_90 instructions (bulk copies, mbarrier tx counts); the kernel body is
// compiled only for sm_90+ and traps elsewhere (the handler refuses older GPUs).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define JAX_PAGED_GROUPED_SM90 1
#else
#define JAX_PAGED_GROUPED_SM90 0
#endif

__device__ __forceinline__ uint32_t SmemAddr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

#if JAX_PAGED_GROUPED_SM90
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void FenceMbarInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ bool MbarTryWait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  while (!MbarTryWait(bar, parity)) {
  }
}
// Orders this thread's ordinary shared-memory accesses before the async proxy's
// (bulk copies, wgmma's operand reads) that a barrier orders after them.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Global -> shared bulk copy of `bytes` (multiple of 16, both ends 16-byte
// aligned), completing on the mbarrier's transaction count.
__device__ __forceinline__ void BulkCopyG2S(uint32_t dst, const void* src, uint32_t bytes,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Global -> shared copy of the box at (x, y) of a 2-D tensor map (a
// __grid_constant__ kernel parameter), completing on the mbarrier's transaction
// count; the map's swizzle mode lays the box out in shared memory.
__device__ __forceinline__ void TensorCopy2dG2S(uint32_t dst, const CUtensorMap* map, int x, int y,
                                                uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
#endif  // JAX_PAGED_GROUPED_SM90

// ldmatrix and mma.sync (sm_80-level instructions): the portable kernel's wrappers.
using sm80::Ldsm2;
using sm80::Ldsm4;
using sm80::Mma1688;
using sm80::Mma16816;

// Two floats rounded to T, packed (lo in the low half): P's A fragment.
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// 2^x, results below 2^-126 flushed to 0 (they weigh nothing next to the
// running maximum's 2^0): exp2f's denormal handling cost 3 more instructions
// per exponential in the loop.
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2 |x|) in [0, 1]: one
// ex2.approx and one fast divide (its divisor is in [1, 2]) instead of
// tanhf's polynomial and branches. Absolute error ~1e-7 (e's relative error
// ~2^-22 is absolute near x = 0, where 1 - e cancels), so a capped logit
// cap * tanh(l / cap) moves by ~cap * 1e-7; tanh(+-inf) = +-1, NaN stays NaN.
__device__ __forceinline__ float FastTanh(float x) {
  const float e = Exp2Ftz(-2.0f * kLog2e * fabsf(x));
  return copysignf(__fdividef(1.0f - e, 1.0f + e), x);
}

// `v`, in a register the compiler cannot see through: keeps a loop-invariant
// value computed once instead of rematerialized inside the loop.
__device__ __forceinline__ int Opaque(int v) {
  asm volatile("" : "+r"(v));
  return v;
}
__device__ __forceinline__ uint32_t Opaque(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}

__device__ __forceinline__ float Dot4(const float4& a, const float4& b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// Four fp8 values (one 32-bit load) widened to two packed f16 pairs, exactly
// (every e4m3 / e5m2 value is an f16 value): lo = bytes 0, 1 and hi = bytes
// 2, 3 (the lower byte in the low half). e5m2 is the top byte of an f16 (one
// byte permute per pair); e4m3 takes one hardware conversion per pair, whose
// operand selects the register's upper half itself when written as below (a
// C++ shift of the upper half cost one extra SHF per pair in the SASS).
// (bf16 products would need four conversions per pair, fp8 -> f16 -> 2 x f32 ->
// bf16, which the conversion rate cannot feed: hence f16 products for every query.)
template <typename TC>
__device__ __forceinline__ void Fp8x4ToHalf2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  if constexpr (std::is_same_v<TC, __nv_fp8_e5m2>) {
    lo = __byte_perm(four, 0u, 0x1404u);
    hi = __byte_perm(four, 0u, 0x3424u);
  } else {
    asm("{\n\t.reg .b16 l16, h16;\n\tmov.b32 {l16, h16}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, l16;\n\tcvt.rn.f16x2.e4m3x2 %1, h16;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(four));
  }
}

// A bf16 query staged for fp8 caches' f16 products: |x| of a packed bf16 pair's
// larger half; the power-of-two scale that puts the rows' largest |q|, amax, in
// [2^14, 2^15) (exact for every value down to 2^-28 of it: f16 has more mantissa
// than bf16; divided out of the logits), clamped to [2^-126, 2^64], 1 for inf / NaN
// or an all-zero query; and a bf16 pair times that scale as an f16 pair.
__device__ __forceinline__ float Bf16PairAbsMax(uint32_t v) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return fmaxf(fabsf(f.x), fabsf(f.y));
}
// The largest |x| of a warp's query fragments (bf16 pairs), over all its lanes.
template <int N>
__device__ __forceinline__ float WarpBf16AbsMax(const uint32_t (&qa)[N][4]) {
  float amax = 0.0f;
#pragma unroll
  for (int ks = 0; ks < N; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) amax = fmaxf(amax, Bf16PairAbsMax(qa[ks][i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  return amax;
}
__device__ __forceinline__ float F16QueryScale(float amax) {
  float scale = 1.0f;
  if (amax > 0.0f && amax <= FLT_MAX) {
    int e = 0;
    (void)frexpf(amax, &e);  // amax < 2^e
    scale = ldexpf(1.0f, min(max(15 - e, -126), 64));
  }
  return scale;
}
__device__ __forceinline__ uint32_t Bf16PairToF16(uint32_t v, float scale) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  const __half2 h = __floats2half2_rn(f.x * scale, f.y * scale);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Four consecutive outputs as one store (8 bytes for 16-bit T, 16 for f32):
// `dst` is aligned to four elements (out is 16-byte aligned, D % 8 == 0).
template <typename T>
__device__ __forceinline__ void StoreFour(T* dst, float4 v) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(dst) = v;
  } else {
    static_assert(sizeof(T) == 2, "16-bit or 32-bit outputs");
    *reinterpret_cast<uint2*>(dst) = make_uint2(PackPair<T>(v.x, v.y), PackPair<T>(v.z, v.w));
  }
}

// Bits 0 .. n-1 of a kWidth-bit mask (16 or 32), n clamped to [0, kWidth]: the
// tokens of a slice before the sequence's end.
template <int kWidth>
__device__ __forceinline__ uint32_t FirstBits(int n) {
  constexpr uint32_t kAll = kWidth == 32 ? 0xFFFFFFFFu : (1u << kWidth) - 1u;
  return n >= kWidth ? kAll : (n <= 0 ? 0u : ((1u << n) - 1u));
}

// (a, b) = (b, a) where `swap` (per lane): the row split's swizzled V fragments.
__device__ __forceinline__ void UnswapPair(uint32_t& a, uint32_t& b, bool swap) {
  const uint32_t lo = swap ? b : a;
  b = swap ? a : b;
  a = lo;
}

// 0xFF in byte i iff bit i of `bits` is set (ANDed in: zeroes masked fp8 values).
__device__ __forceinline__ uint32_t ByteMask(uint32_t bits) {
  return ((bits & 1u) ? 0x000000FFu : 0u) | ((bits & 2u) ? 0x0000FF00u : 0u) |
         ((bits & 4u) ? 0x00FF0000u : 0u) | ((bits & 8u) ? 0xFF000000u : 0u);
}

// A staging unit of fp8 caches' query rows: 16 dims of a row as two 16-byte
// loads, source pairs 0-3 (lo) and 4-7 (hi), stored with the pairs permuted.
struct QueryChunk {
  uint4 lo, hi;
};

// Query staging of the row split (32 or 64 rows): units i =
// tid, tid + kThreads, ... < kN of the rows, stored as store(i, load(i)), with the
// loads of up to kBatch units issued before their stores, so that they share one
// trip to memory instead of a run-time loop's one or two per unit. (The 16-bit and
// f32 decode kernels keep their run-time loops; the fp8 decode kernels stage
// QueryChunk units through it.)
template <int kN, int kBatch, typename Load, typename Store>
__device__ __forceinline__ void StageUnitsBatched(int tid, Load&& load, Store&& store) {
  constexpr int kPerThread = (kN + kThreads - 1) / kThreads;
  using U = decltype(load(0));
#pragma unroll
  for (int b = 0; b < kPerThread; b += kBatch) {
    U v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = tid + (b + j) * kThreads;  // (>= kN past the thread's last unit)
      if (i < kN) v[j] = load(i);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = tid + (b + j) * kThreads;
      if (i < kN) store(i, v[j]);
    }
  }
}

#ifdef JAX_PAGED_TRACE
// Trace builds only (CMake -DJAX_PAGED_TRACE=ON): per-CTA timeline for finding
// where a call's time goes (dev/trace_case.py). Row of CTA (x, y, z) = x + gridDim.x * (y +
// gridDim.y * z): [entry, first stage arrived, last tile done, exit] in ns
// of %globaltimer, then SM id, tiles, SM clock cycles from entry to the last
// tile done and from there to the exit, then (ns) every warp's tiles done
// (the merge's first barrier passed) and the merge buffer written (its
// second barrier passed): they split "last tile done -> exit" into waiting for
// the other warps, the merge and the output stores; then (ns) thread 0's first
// copies issued and the query rows staged (the prologue's last barrier passed):
// they split "entry -> first stage arrived".
constexpr int kTraceWords = 12;
__device__ __forceinline__ unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned SmId() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#endif

// ---- the kernel -----------------------------------------------------------------
// grid (num_kv_heads * group_chunks, num_seqs chunk, GroupedGridPartitions(p)),
// kThreads threads, GroupedConfig::kSmemBytes of dynamic shared memory. With
// a sliding window the grid may hold fewer partitions than the workspace
// (max_num_partitions): CTA z then runs partition z + (the partition of the
// first token its rows attend), so that no CTA is launched for the
// partitions before a sequence's window.
//
// Rows: the CTA's query rows are rows [chunk * rows_per_cta, + rows) of its
// KV head's q_len * group rows, row g = qi * group + h (query position qi,
// head h of the group), so that a decode step's rows are the group's heads.
// Row g attends tokens QueryRowRange(L, q_len, qi, sliding_window); the CTA
// reads the blocks of the union of its rows' ranges (within its partition).
//
// fp8 caches: S = Q K^T and O += P V run the f16 mma, with the fp8 values
// widened to f16 in registers (exact) and P rounded to f16; a bf16 query is
// staged as f16 times a power of two (q_scale, divided out of the logits) so
// that no value overflows f16. Because both products sum over an index, the
// kernel is free to permute it: within each 16-dim chunk of K, lane tq loads
// the 4 bytes of dims 4tq..4tq+3 (one 32-bit load) as the mma's k indices
// 2tq, 2tq+1, 2tq+8, 2tq+9, and the query is staged in shared memory with the
// same permutation; the S columns (tokens) are permuted likewise, so that P's
// k indices 2tq, 2tq+1, 2tq+8, 2tq+9 are the 4 consecutive tokens 4tq..4tq+3
// whose V bytes (V rows are token-contiguous) are again one 32-bit load.
// kPlain: q_len == 1, no ALiBi, no soft cap unless kCap (a decode step): every
// row of a CTA attends the same tokens, [0, L) or with a sliding window
// [max(0, L - w), L), with logit = scale * q.k, so the per-row range test and
// the ALiBi term leave the hot loop (the window's start is in the tile mask).
// kBlockSize: 0, the block size read from p at run time (16-bit and f32
// caches); else it (8, 16 or 32, equal to p.block_size), a compile-time
// constant (fp8 caches, see SelectGroupedKernel).
// kCap (with kPlain): the plain step with a logit soft cap (16-bit caches,
// see SelectGroupedKernel).
// kRowBlocks (the row split when > 1, see RowBlocks): 16 * kRowBlocks
// query rows per CTA, warp w computing row block w / kSliceGroups over slices
// w % kSliceGroups + j * kSliceGroups of each tile, all in one pass
// (GroupedConfig); the epilogue merges the kSliceGroups partials of each row.
// kWgmma: the row split's warpgroup-product form (wgmma.cuh; compute capability
// 9.0, 16-bit caches).
// kHalfRows (with kPlain): CTAs of at most 8 query rows (see below).
// kWarpgroups (with kWgmma): 2 for CTAs of 128 rows, warpgroup g computing rows
// 64 g.. over the same stages (warp w holds row block w), so that a KV head of
// 65-128 rows copies each page once, not once per 64-row CTA; one CTA per SM.
// kDeferPv (true with two warpgroups, false elsewhere): tile k's P.V is issued at
// the start of tile k + 1, so that it and tile k + 2's Q.K both run while tile
// k + 1's softmax computes; each iteration ends with every
// product done (nothing in flight across the loop's back edge) and releases the stage
// of the tile before.
template <typename T, typename TC, int D, bool kPlain, int kBlockSize = 0, bool kCap = false,
          int kRowBlocks = 1, bool kWgmma = false, bool kHalfRows = false, int kWarpgroups = 1,
          bool kDeferPv = false, int kFp8Ctas = 0>
__global__ void __launch_bounds__(
    (GroupedConfig<static_cast<int>(sizeof(T)), static_cast<int>(sizeof(TC)), D, kRowBlocks,
                   kWarpgroups, kFp8Ctas>::kCtaThreads),
    (GroupedConfig<static_cast<int>(sizeof(T)), static_cast<int>(sizeof(TC)), D,
                             kRowBlocks, kWarpgroups, kFp8Ctas>::kCtasPerSm))
    GroupedAttentionKernel(const PagedAttentionParams p, const int seq_base,
                           const int group_chunks, const int rows_per_cta,
                           const bool direct_out, const __grid_constant__ CUtensorMap v_map) {
#if !JAX_PAGED_GROUPED_SM90
  __trap();
#else
  using C = GroupedConfig<static_cast<int>(sizeof(T)), static_cast<int>(sizeof(TC)), D, kRowBlocks,
                          kWarpgroups, kFp8Ctas>;
  constexpr int kStages = C::kStages;
  // Threads of the CTA (the loops over its rows and a stage's rows stride by it).
  constexpr int kCtaThreads = C::kCtaThreads;
  constexpr bool kRowSplit = C::kRowSplit;
  static_assert(!kWgmma || (kRowBlocks == 4 && D % 16 == 0 && !kPlain && kBlockSize > 0 &&
                             C::kCtasPerSm == 3 - kWarpgroups),
                "wgmma: the row split's 64-row CTAs at two per SM (128-row CTAs: one), "
                "head_size % 16 == 0, one block size");
  // kHalfRows: the plain step's kernel for CTAs of at most 8 query rows (up to 8
  // query heads per KV head): the mma rows gid + 8 are padding, so the loop
  // skips their logits, exponentials, sums and O rescale (the products still
  // compute them: an mma row depends on its own A row only, and they are never
  // written).
  static_assert(!kHalfRows || (kPlain && kRowBlocks == 1 && C::kMma),
                "half rows: the plain mma decode step");
  constexpr int kFragRows = kHalfRows ? 1 : 2;  // fragment rows (gid, gid + 8) computed
#ifdef JAX_PAGED_TRACE
  // Thread 0 stores each of the CTA's timestamps into its trace row when it takes it
  // (the row's entry clock first, replaced by a difference at the exit), and the row's
  // address is computed where it is used, so that nothing is held in registers across
  // the tile loop: held, the timestamps made the 255-register deferred-P.V kernels
  // spill. A CTA that exits early leaves its exit word zero.
  auto trace_row = [&]() -> unsigned long long* {
    const int64_t cta = blockIdx.x + static_cast<int64_t>(gridDim.x) *
                                         (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
    return threadIdx.x == 0 && p.trace != nullptr && cta < p.trace_capacity
               ? p.trace + cta * kTraceWords
               : nullptr;
  };
  if (unsigned long long* row = trace_row()) {
    row[0] = GlobalTimerNs();
    row[6] = static_cast<unsigned long long>(clock64());
  }
  unsigned long long t_loop_end = 0, t_all_loops = 0, t_merged = 0;
  long long c_loop_end = 0;
#endif
  constexpr bool kFp8 = C::kFp8;
  // Tensor-core operand type: the query's, or f16 for fp8 caches (see above).
  using TM = std::conditional_t<kFp8, __half, T>;
  // The wgmma form reads 16-bit caches of the query's dtype only.
  constexpr bool kWgmmaFp8 = kWgmma && kFp8;
  static_assert(!kWgmmaFp8, "wgmma: 16-bit caches of the query's dtype only");

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int kv_head = blockIdx.x / group_chunks;
  const int chunk = blockIdx.x - kv_head * group_chunks;
  const int seq = seq_base + static_cast<int>(blockIdx.y);
  const int group = p.num_heads / p.num_kv_heads;
  const int q_len = p.q_len;
  const int row0 = chunk * rows_per_cta;                            // first row (of q_len * group)
  const int rows = min(rows_per_cta, q_len * group - row0);         // rows here
  if (rows <= 0) return;
  // Workspace / out / lse row of local row r: ((seq, qi), head).
  // (A plain decode step has q_len == 1, so qi == 0: no run-time division in
  // the query staging and output loops.)
  auto hrow_of = [&](int r) -> int64_t {
    const int g = row0 + r;
    const int qi = kPlain ? 0 : g / group;
    return (static_cast<int64_t>(seq) * q_len + qi) * p.num_heads + kv_head * group +
           (g - qi * group);
  };

  const int BS = kBlockSize > 0 ? kBlockSize : p.block_size;  // 8, 16 or 32 (checked by the handler)
  // (__ffs of a constant is not folded: the constant case is spelled out.)
  const int log2_bs = kBlockSize > 0 ? Log2(kBlockSize) : __ffs(BS) - 1;
  const int ppt = C::kTile >> log2_bs;  // pages per tile (1..16)
  const int blocks_per_part = p.partition_size >> log2_bs;
  const int64_t guess_blk64 = static_cast<int64_t>(blockIdx.z) * blocks_per_part;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;

  // Warp 0 fetches the first stages' table entries before waiting for
  // seq_lens (independent loads; entries past the sequence are loaded but
  // never used). Right unless a sliding window moves the first block.
  int32_t first_entries[kStages];
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      const int64_t blk = guess_blk64 + i * ppt + lane;
      first_entries[i] = (lane < ppt && blk < p.max_blocks_per_seq) ? table[blk] : -1;
    }
  }

  const int L = EffectiveSeqLen(p.seq_lens[seq], p.max_blocks_per_seq, BS);
  const int P = p.max_num_partitions;
  // Union of the rows' ranges: qi grows with the row, and so do start and end.
  const TokenRange first_range = QueryRowRange(L, q_len, row0 / group, p.sliding_window);
  const TokenRange last_range = QueryRowRange(L, q_len, (row0 + rows - 1) / group, p.sliding_window);
  // A grid of fewer partitions than the workspace's (a window, GroupedGridPartitions)
  // counts from the partition of the rows' first token; one past the table has none.
  const int part = static_cast<int>(blockIdx.z) +
                   (static_cast<int>(gridDim.z) < P ? first_range.start / p.partition_size : 0);
  if (part >= P) return;
  const int64_t part_blk64 = static_cast<int64_t>(part) * blocks_per_part;
  const int union_end_blk = (last_range.end + BS - 1) >> log2_bs;
  const int64_t start_blk64 =
      std::max<int64_t>(part_blk64, static_cast<int64_t>(first_range.start >> log2_bs));
  const int end_blk = static_cast<int>(
      std::min<int64_t>(part_blk64 + blocks_per_part, static_cast<int64_t>(union_end_blk)));

  if (start_blk64 >= end_blk) {
    // Nothing to attend here: a well-defined empty result, then exit. With a
    // single partition: out = 0, lse = -inf.
    for (int i = tid; i < rows * D; i += kCtaThreads) {
      const int r = i / D;
      const int d = i - r * D;
      const int64_t hrow = hrow_of(r);
      if (direct_out) {
        static_cast<T*>(p.out)[hrow * D + d] = FromFloat<T>(0.0f);
        if (d == 0 && p.lse != nullptr) p.lse[hrow] = -INFINITY;
      } else {
        p.tmp_out[(hrow * P + part) * D + d] = 0.0f;
        if (d == 0) {
          p.max_logits[hrow * P + part] = -FLT_MAX;
          p.exp_sums[hrow * P + part] = 0.0f;
        }
      }
    }
    return;
  }

  const int start_blk = static_cast<int>(start_blk64);
  const int ntiles = (end_blk - start_blk + ppt - 1) / ppt;  // >= 1

  // (wgmma's swizzled V layouts repeat every 256 / 512 bytes of address: the
  // stages start 1 KB aligned; stage, K / V region and page sizes keep that.)
  extern __shared__ __align__(kWgmma ? 1024 : 128) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem + C::kQOff);
  float* ml_s = reinterpret_cast<float*>(smem + C::kMlOff);
  uint32_t* mask_s = reinterpret_cast<uint32_t*>(smem + C::kMaskOff);
  const uint32_t stages_addr = SmemAddr(smem);
  const uint32_t bar0 = SmemAddr(smem + C::kBarOff);
  uint32_t* release_count_s = reinterpret_cast<uint32_t*>(smem + C::kCountOff);
  int32_t* refill_table_s = reinterpret_cast<int32_t*>(smem + C::kTableOff);

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      MbarInit(bar0 + 8 * s, 1);
      release_count_s[s] = 0u;
    }
    FenceMbarInit();
  }
  __syncthreads();

  // ---- producer (warp 0 for the first stages, then the warp that releases a
  // stage last; lane i < ppt copies page i of a tile) ---------------------------
  const int page_elems = D * BS;
  const uint32_t page_bytes = static_cast<uint32_t>(page_elems * sizeof(TC));
  const int64_t kv_block_stride = static_cast<int64_t>(p.num_kv_heads) * page_elems;
  const int64_t kv_head_off = static_cast<int64_t>(kv_head) * page_elems;
  const TC* key_cache = static_cast<const TC*>(p.key_cache);
  const TC* value_cache = static_cast<const TC*>(p.value_cache);

  auto load_entry = [&](int tile) -> int32_t {
    const int blk = start_blk + tile * ppt + lane;
    return (lane < ppt && blk < end_blk) ? table[blk] : -1;
  };
  // All 32 lanes of the refilling warp call it (ballot).
  auto issue = [&](int tile, int stage, int32_t entry) {
#ifdef JAX_PAGED_PROBE_NO_LOADS
    // Timing probe (development, wrong results): after the first kStages tiles
    // a stage keeps the tile (and page mask) it holds and is re-armed with no
    // bytes, so the loop runs its arithmetic without waiting for memory.
    if (tile >= kStages) {
      if (lane == 0) MbarArriveExpectTx(bar0 + 8 * stage, 0u);
      return;
    }
#endif
    const int blk = start_blk + tile * ppt + lane;
    const int64_t phys = entry;
    const bool ok = lane < ppt && blk < end_blk && phys >= 0 && phys < p.num_blocks;
    const uint32_t pages = __ballot_sync(0xffffffffu, ok);
    const uint32_t bar = bar0 + 8 * stage;
    if (lane == 0) {
      mask_s[stage] = pages;  // published by the arrive (release) below
      MbarArriveExpectTx(bar, static_cast<uint32_t>(__popc(pages)) * 2u * page_bytes);
    }
    __syncwarp();
    if (ok) {
      const int64_t src = phys * kv_block_stride + kv_head_off;
      const uint32_t dst = stages_addr + static_cast<uint32_t>(stage) * C::kStageBytes +
                           static_cast<uint32_t>(lane) * page_bytes;
      BulkCopyG2S(dst, key_cache + src, page_bytes, bar);
      const uint32_t dst_v = dst + C::kTileElems * sizeof(TC);
      if constexpr (kWgmma) {
        // The V page as the box of rows (phys * num_kv_heads + kv_head) * D.. of
        // v_map ([rows][BS] with the products' swizzle, EncodeValueTensorMap):
        // it arrives in P.V's operand layout. (The launcher checks that the
        // rows fit an int.)
        const int v_row = static_cast<int>((phys * p.num_kv_heads + kv_head) * D);
        TensorCopy2dG2S(dst_v, &v_map, 0, v_row, bar);
      } else {
        BulkCopyG2S(dst_v, value_cache + src, page_bytes, bar);
      }
    }
  };

  // The table entries of each stage's next refill (tile k + kStages for the stage
  // holding tile k) wait in refill_table_s. A warp that refills a stage loads the
  // entries of that stage's refill after it into `pending_entry` and stores them
  // at its next release, when the load has long returned (a store right after
  // the load would stall the warp on it); that release comes before every warp
  // has released the refilled tile, so before the stage's next refill reads them.
  int32_t pending_entry = -1;
  int pending_stage = -1;  // warp-uniform; -1: nothing pending
  int32_t last_first_entry = -1;  // warp 0, kQInStage: the last stage's first entry
  // kRegIO: the query rows straight into registers (below), so the last stage's
  // first copies need not wait for them, and the output written from registers:
  // the wgmma form, and the fp8 64-row row split at two CTAs per SM (head sizes
  // 80-128; one slice group: each warp holds whole rows). The mma.sync form of
  // 16-bit caches (KernelOptions::wgmma off, or a build without sm_90a) keeps the
  // staging. (C::kQInRegs: the row split, not the wide one; fp8 caches and wgmma
  // both have D % 16 == 0.)
  constexpr bool kRegIO =
      kWgmma || (kFp8 && C::kQInRegs && C::kMergeSlices == 1 && C::kCtasPerSm <= 2);
  constexpr bool kQInStage = C::kQInStage && !kRegIO;
  // (Two warpgroups: the paths below that stage through shared memory assume 4 warps.)
  static_assert(kWarpgroups == 1 || (kRegIO && kWgmma), "two warpgroups: kRegIO");
  // (Deferred P.V: a stage is refilled a tile later, which the two warpgroups' six
  // stages allow: tile k + 1 was issued at the release of tile k + 1 - kStages.)
  static_assert(!kDeferPv || (kWarpgroups == 2 && kStages >= 4), "deferred P.V: 128-row CTAs");
  if (warp == 0) {
    if (start_blk64 != guess_blk64) {  // a sliding window moved the first block
#pragma unroll
      for (int i = 0; i < kStages; ++i) first_entries[i] = load_entry(i);
    }
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      // (The row split stages its query rows in the last stage: that one's
      // copies wait until the rows are in registers, below.)
      if (i < ntiles && !(kQInStage && i == kStages - 1)) issue(i, i, first_entries[i]);
    }
    if constexpr (kQInStage) last_first_entry = first_entries[kStages - 1];
#pragma unroll
    for (int i = 0; i < kStages; ++i)  // the second refills, stored after the query staging
      first_entries[i] = kStages + i < ntiles ? load_entry(kStages + i) : -1;
  }
#ifdef JAX_PAGED_TRACE
  if (unsigned long long* row = trace_row()) row[10] = GlobalTimerNs();
#endif
  AllowDependentLaunch();  // the reduce (if any) may now be scheduled; it waits for us

  // ---- query rows -> shared memory (rows >= `rows` zero; kRegIO: registers),
  // overlapping the copies. Row split: the warp's 16 query rows as mma A fragments,
  // loaded once (the decode kernel reloads them per slice: with every warp walking
  // several slices, that was a third of the row split's shared-memory reads). (Not
  // the wide row split, C::kQInRegs false: it reads them per product, from its own
  // buffer.)
  uint32_t qa[C::kQInRegs ? D / 16 : 1][4];
  uint32_t qa_tail[2];
  float q_scale = 1.0f;  // fp8 caches: the staged f16 query is query * q_scale
  if constexpr (kRegIO) {
    // Straight from global memory into the fragments that ldmatrix would read from
    // staged rows (row block w = warp: rows gid and gid + 8 in registers 0, 2 and
    // 1, 3; k indices 16 ks + 2 tq, + 1 and + 8, + 9), zero past `rows`: no staging
    // store, CTA barrier and ldmatrix, and no stage held for the rows.
    const int lr0 = (warp / C::kSliceGroups) * kMaxRows + (lane >> 2);
    const int tq4 = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int lr = lr0 + 8 * h;
      const bool ok = lr < rows;
      const T* row = static_cast<const T*>(p.query) + (ok ? hrow_of(lr) : 0) * D;
      if constexpr (kFp8) {
        // The permuted pairs (see above): k indices 2 tq, + 1 (logical pair tq) and
        // 2 tq + 8, + 9 (pair tq + 4) hold dims 16 ks + 4 tq .. + 3: one 8-byte load.
        const uint2* src = reinterpret_cast<const uint2*>(row) + tq4;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          const uint2 v = ok ? src[4 * ks] : make_uint2(0u, 0u);
          qa[ks][h] = v.x;
          qa[ks][h + 2] = v.y;
        }
      } else {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(row) + tq4;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
          for (int c = 0; c < 2; ++c) qa[ks][h + 2 * c] = ok ? src[ks * 8 + 4 * c] : 0u;
      }
    }
    if constexpr (kFp8 && std::is_same_v<T, __nv_bfloat16>) {
      // bf16 -> f16 times a power of two, as the staging below does, but from the
      // warp's own 16 rows (each warp's logits use only its own rows' scale).
      q_scale = F16QueryScale(WarpBf16AbsMax(qa));
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) qa[ks][i] = Bf16PairToF16(qa[ks][i], q_scale);
    }
  } else if constexpr (kFp8) {
    // Pairs permuted within each 16-dim chunk (see above): logical pair j of
    // chunk c (dims 16c + 2j, +1) holds dims 16c + 4 (j & 3) + 2 (j >> 2), +1.
    // Staged per 16-dim chunk of a row (a unit: two 16-byte loads), so that a
    // thread's loads are few and all in flight at once.
    constexpr int kUnits = C::kRows * (D / 16);
    constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
    // Unit i's first word in q_s (row i / (D / 16), chunk i % (D / 16)).
    auto unit_word = [&](int i) -> int {
      const int r = i / (D / 16);
      return (r * C::kQStride) / 2 + (i - r * (D / 16)) * 8;
    };
    uint32_t* q_words = reinterpret_cast<uint32_t*>(q_s);
    float amax = 0.0f;
    // The row split at four CTAs per SM (head sizes up to 64, 128 registers) keeps
    // the pairwise staging (one 4-byte load per pair of dims): with the units
    // ptxas 13.0 spilled 12-16 bytes there, into its tile loop.
    constexpr bool kPairwise = kRowSplit && C::kCtasPerSm > 2;
    constexpr int kPairs = D / 2;
    // Logical pair i's word in q_s (row i / kPairs).
    auto pair_word = [&](int i) -> int {
      const int r = i / kPairs;
      return (r * C::kQStride) / 2 + (i - r * kPairs);
    };
    if constexpr (kPairwise) {
      StageUnitsBatched<C::kRows * kPairs, 8>(
          tid,
          [&](int i) -> uint32_t {  // logical pair i (below), zero past `rows`
            const int r = i / kPairs;
            const int lp = i - r * kPairs;
            const int src_pair = (lp & ~7) + 2 * (lp & 3) + ((lp & 7) >> 2);
            return r < rows ? *reinterpret_cast<const uint32_t*>(static_cast<const T*>(p.query) +
                                                                 hrow_of(r) * D + 2 * src_pair)
                            : 0u;
          },
          [&](int i, uint32_t v) {
            if constexpr (kBf16) amax = fmaxf(amax, Bf16PairAbsMax(v));
            q_words[pair_word(i)] = v;
          });
    } else {
      StageUnitsBatched<kUnits, 4>(
          tid,
          [&](int i) -> QueryChunk {  // zero past `rows`
            const int r = i / (D / 16);
            if (r >= rows) return {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
            const uint4* src = reinterpret_cast<const uint4*>(
                static_cast<const T*>(p.query) + hrow_of(r) * D + (i - r * (D / 16)) * 16);
            return {src[0], src[1]};
          },
          [&](int i, const QueryChunk& c) {
            if constexpr (kBf16) {
              const uint32_t w[8] = {c.lo.x, c.lo.y, c.lo.z, c.lo.w, c.hi.x, c.hi.y, c.hi.z, c.hi.w};
#pragma unroll
              for (int j = 0; j < 8; ++j) amax = fmaxf(amax, Bf16PairAbsMax(w[j]));
            }
            // Logical pairs 0-3: the source's even pairs; 4-7: its odd ones.
            uint4* dst = reinterpret_cast<uint4*>(q_words + unit_word(i));
            dst[0] = make_uint4(c.lo.x, c.lo.z, c.hi.x, c.hi.z);
            dst[1] = make_uint4(c.lo.y, c.lo.w, c.hi.y, c.hi.w);
          });
    }
    if constexpr (kBf16) {
      // bf16 -> f16 with the power-of-two scale of the CTA's largest |q|
      // (F16QueryScale).
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (lane == 0) ml_s[warp] = amax;
      __syncthreads();
      amax = fmaxf(fmaxf(ml_s[0], ml_s[1]), fmaxf(ml_s[2], ml_s[3]));
      q_scale = F16QueryScale(amax);
      auto to_f16 = [&](uint32_t v) -> uint32_t { return Bf16PairToF16(v, q_scale); };
      if constexpr (kPairwise) {
        for (int i = tid; i < C::kRows * kPairs; i += kCtaThreads)  // this thread's own pairs
          q_words[pair_word(i)] = to_f16(q_words[pair_word(i)]);
      } else {
        for (int i = tid; i < kUnits; i += kCtaThreads) {  // this thread's own units
          uint4* u = reinterpret_cast<uint4*>(q_words + unit_word(i));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 v = u[h];
            u[h] = make_uint4(to_f16(v.x), to_f16(v.y), to_f16(v.z), to_f16(v.w));
          }
        }
      }
    }
  } else {
    constexpr int kChunks = D / C::kQX;
    if constexpr (kRowSplit) {
      StageUnitsBatched<C::kRows * kChunks, 16>(
          tid,
          [&](int i) -> uint4 {  // chunk i, zero past `rows`
            const int r = i / kChunks;
            if (r >= rows) return make_uint4(0u, 0u, 0u, 0u);
            return *reinterpret_cast<const uint4*>(static_cast<const T*>(p.query) + hrow_of(r) * D +
                                                   (i - r * kChunks) * C::kQX);
          },
          [&](int i, const uint4& v) {
            const int r = i / kChunks;
            *reinterpret_cast<uint4*>(q_s + r * C::kQStride + (i - r * kChunks) * C::kQX) = v;
          });
    } else {
      for (int i = tid; i < C::kRows * kChunks; i += kCtaThreads) {
        const int r = i / kChunks;
        const int c = i - r * kChunks;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows)
          v = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.query) + hrow_of(r) * D +
                                              c * C::kQX);
        *reinterpret_cast<uint4*>(q_s + r * C::kQStride + c * C::kQX) = v;
      }
    }
  }
  if (warp == 0 && lane < C::kMaxTilePages) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) refill_table_s[i * C::kMaxTilePages + lane] = first_entries[i];
  }
  __syncthreads();

  // ---- per-warp constants ------------------------------------------------------
  // slice: the warp's (first) token slice of each tile and its merge slot in the
  // epilogue (row split: the warp walks slices slice + j * kSliceGroups); rb: the
  // warp's block of 16 query rows (row split), else 0.
  const int slice = kRowSplit ? warp % C::kSliceGroups : warp / C::kWarpsPerSlice;
  const int rb = kRowSplit ? warp / C::kSliceGroups : 0;
  // The warp's share of the head dims when two warps share a slice (else 0; the
  // row split has one warp per slice and all dims).
  const int dsub = kRowSplit ? 0 : warp - slice * C::kWarpsPerSlice;
  const int dim0 = dsub * C::kDimsPerWarp;
  const int gid = lane >> 2;  // fragment row (rows gid and gid + 8)
  const int tq = lane & 3;    // fragment column pair
  // 16-token sub-slices a warp computes per tile in one pass, kSubStride tokens
  // apart: fp8's contiguous sub-slices of a 32-token slice, or the row split's
  // slices (every kSliceGroups-th of the tile). One pass over all of them gives
  // the row split 2 * kSub independent Q.K accumulator chains and one max
  // shuffle / O rescale per tile instead of per 16 tokens.
  constexpr int kSub = kRowSplit ? C::kSlicesPerWarp : C::kSubSlices;
  constexpr int kSubStride = kRowSplit ? 16 * C::kSliceGroups : 16;
  constexpr int kSliceTokens = 16 * C::kSubSlices;  // tokens of a warp's (first) slice
  // Bit 16 h + j of a slice mask: token j of sub-slice h.
  using Mask = std::conditional_t<(kSub > 2), uint64_t, uint32_t>;
  constexpr Mask kFullMask = kSub == 4 ? ~Mask{0} : (kSub == 2 ? Mask{0xFFFFFFFFu} : Mask{0xFFFFu});
  const int slice_tok = slice * kSliceTokens;
  int pg[2 * kSub];  // page of tokens 8 (q & 1)..+7 of sub-slice q >> 1
#pragma unroll
  for (int q = 0; q < 2 * kSub; ++q)
    pg[q] = (slice_tok + kSubStride * (q >> 1) + 8 * (q & 1)) >> log2_bs;
  const float k_scale = p.k_scale != nullptr ? p.k_scale[kv_head * p.k_scale_stride] : 1.0f;
  const float v_scale = p.v_scale != nullptr ? p.v_scale[kv_head * p.v_scale_stride] : 1.0f;
  const float soft_cap = p.soft_cap;
  // Without a soft cap the logits are computed directly in log2 units; with
  // one, in natural units, capped, then converted.
  const float qk_scale = p.scale * k_scale * (soft_cap > 0.0f ? 1.0f : kLog2e) / q_scale;
  const float cap_inv = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;
  const float cap2 = soft_cap * kLog2e;
  // This lane's two rows: ALiBi slope (units of qk_scale) and token range.
  float slope[2] = {0.0f, 0.0f};
  int r_start[2] = {0, 0}, r_end[2] = {0, 0};  // empty for padding rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int lr = rb * kMaxRows + gid + 8 * r;
    if (lr < rows) {
      const int g = row0 + lr;
      const int qi = g / group;
      const TokenRange range = QueryRowRange(L, q_len, qi, p.sliding_window);
      r_start[r] = range.start;
      r_end[r] = range.end;
      if (p.alibi_slopes != nullptr)
        slope[r] = p.alibi_slopes[kv_head * group + (g - qi * group)] *
                   (soft_cap > 0.0f ? 1.0f : kLog2e);
    }
  }

  // Row split: a pass whose first token tbase is in [all_valid_lo, all_valid_hi]
  // lies inside the token range of every row of the warp (rows past the CTA's
  // count do not matter: their results are never written); never with ALiBi.
  int all_valid_lo = INT_MAX, all_valid_hi = INT_MIN;
  if constexpr (kRowSplit) {
    constexpr int kPassSpan = kSubStride * (kSub - 1) + 16;  // tokens from a pass's first to its last
    int lo = INT_MIN, hi = INT_MAX;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (rb * kMaxRows + gid + 8 * r < rows) {
        lo = max(lo, r_start[r]);
        hi = min(hi, r_end[r] - kPassSpan);
      }
    }
    lo = __reduce_max_sync(0xffffffffu, lo);
    hi = __reduce_min_sync(0xffffffffu, hi);
    if (p.alibi_slopes == nullptr) {
      all_valid_lo = lo;
      all_valid_hi = hi;
    }
  }
  float m_run[2] = {-FLT_MAX, -FLT_MAX};  // running max (log2 units), rows gid, gid + 8
  float l_run[2] = {0.0f, 0.0f};          // running sum (this lane's columns)
  float o[C::kNTiles][4];                 // O fragments, dims dim0 + nt * 8 + 2 tq (+1)
#pragma unroll
  for (int n = 0; n < C::kNTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  // Token (0..15 within the slice) of S fragment element s[nt][e]. (fp8 caches
  // load each lane's K tokens so that lane tq's columns are tokens 4 tq .. 4 tq + 3.)
  auto token_of = [&](int nt, int e) -> int {
    return kFp8 ? 4 * tq + 2 * nt + (e & 1) : nt * 8 + 2 * tq + (e & 1);
  };

  // Shared-memory byte offsets (within a stage's K or V region) of this lane's
  // ldmatrix rows (16-bit caches) or 32-bit loads (fp8 caches).
  uint32_t q_addr = 0, k_off = 0, k_tail_off = 0, v_off = 0;
  // Row split: V row i of an ldmatrix matrix reads 8-token half VSwizzle(i) ^ (its
  // own); this lane's two V registers of a pair then come swapped (see below).
  // (The swap costs two SEL per register pair, 128 of the ~800 instructions of
  // a warp's 64-token tile at 16-token pages, less than the conflicts it avoids.)
  auto VSwizzle = [&](int i) -> int {
    return BS == 16 ? (i >> 2) & 1 : (BS == 32 ? (i >> 1) & 1 : 0);
  };
  bool v_swap = false;
  uint32_t k8_off[kSub] = {}, v8_off[kSub] = {};  // fp8: per sub-slice
  // Element offsets of this lane's four tokens (f32 path).
  int kf_off[2][2] = {{0, 0}, {0, 0}};
  if constexpr (C::kMma) {
    q_addr = SmemAddr(q_s) + ((rb * kMaxRows + ((lane >> 3) & 1) * 8 + (lane & 7)) * C::kQStride +
                              (lane >> 4) * 8) * 2;
    if constexpr (kFp8) {
      // Tokens tk and tk + 2 are in one page (tk % 4 < 2 and pages hold a
      // multiple of 4 tokens), so the second n-tile's K is 2 * 16 bytes on.
#pragma unroll
      for (int h = 0; h < kSub; ++h) {
        const int tk = slice_tok + kSubStride * h + 4 * (gid >> 1) + (gid & 1);
        k8_off[h] = (tk >> log2_bs) * page_elems + (tk & (BS - 1)) * 16 + 4 * tq;
        const int tv = slice_tok + kSubStride * h + 4 * tq;
        v8_off[h] = (tv >> log2_bs) * page_elems + (dim0 + gid) * BS + (tv & (BS - 1));
      }
    } else {
      const int tk = slice_tok + (lane >> 4) * 8 + (lane & 7);
      k_off = ((tk >> log2_bs) * page_elems + (((lane >> 3) & 1) * BS + (tk & (BS - 1))) * 8) * 2;
      const int tk2 = slice_tok + ((lane >> 3) & 1) * 8 + (lane & 7);
      k_tail_off =
          ((tk2 >> log2_bs) * page_elems + ((D / 8 - 1) * BS + (tk2 & (BS - 1))) * 8) * 2;
      int half = (lane >> 3) & 1;  // the matrix's 8-token half
      if constexpr (kRowSplit) {
        // The row split reads each V tile once per row block, so V's bank conflicts
        // weigh: an 8x8 matrix's rows are dims d..d+7, BS * 2 bytes apart, and with
        // 16-token pages dims d and d + 4 share banks (32-token pages: d, d + 2,
        // d + 4, d + 6). Rows i with VSwizzle(i) set read the other 8-token half
        // instead, 16 bytes on (16-token pages: conflict-free; 32: two-way instead of
        // four-way; 8-token pages are conflict-free as they are), and lanes whose
        // fragment row is such a row swap their two registers back (v_swap).
        half ^= VSwizzle(lane & 7);
        v_swap = VSwizzle(gid) != 0;
      }
      const int tv = slice_tok + half * 8;
      v_off = ((tv >> log2_bs) * page_elems + (dim0 + (lane >> 4) * 8 + (lane & 7)) * BS +
               (tv & (BS - 1))) * 2;
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tk = slice_tok + nt * 8 + 2 * tq + e;
        kf_off[nt][e] = (tk >> log2_bs) * page_elems + (tk & (BS - 1)) * 4;
      }
  }

  // The per-lane offsets are loop-invariant, but nvcc recomputed them from
  // threadIdx in every tile (~60 SASS instructions per tile of the fp8 loop);
  // opaque copies stay in registers.
  const int slice_tok_r = Opaque(slice_tok);
#pragma unroll
  for (int q = 0; q < 2 * kSub; ++q) pg[q] = Opaque(pg[q]);
  q_addr = Opaque(q_addr);
  k_off = Opaque(k_off);
  k_tail_off = Opaque(k_tail_off);
  v_off = Opaque(v_off);
#pragma unroll
  for (int h = 0; h < kSub; ++h) {
    k8_off[h] = Opaque(k8_off[h]);
    v8_off[h] = Opaque(v8_off[h]);
  }
  // 16-bit caches: the lane offsets of sub-slice h (the row split's slice h),
  // st = kSubStride * h tokens on from the first. They stay within one page when
  // shifted by st: st is a multiple of 16, and of 32 unless the warp's first slice
  // is slice 0 (whose offsets lie in a page's first 16 tokens), with pages of 8,
  // 16 or 32 tokens.
  uint32_t k_off_h[kSub], k_tail_off_h[kSub], v_off_h[kSub];
#pragma unroll
  for (int h = 0; h < kSub; ++h) {
    k_off_h[h] = k_off;
    k_tail_off_h[h] = k_tail_off;
    v_off_h[h] = v_off;
    if constexpr (kRowSplit && !kFp8) {
      const int st = kSubStride * h;
      const uint32_t page_shift = static_cast<uint32_t>((st >> log2_bs) * page_elems);
      const uint32_t tok_shift = static_cast<uint32_t>(st & (BS - 1));
      k_off_h[h] = Opaque(k_off + (page_shift + tok_shift * 8) * 2);  // 8 elements per K token
      k_tail_off_h[h] = Opaque(k_tail_off + (page_shift + tok_shift * 8) * 2);
      v_off_h[h] = Opaque(v_off + (page_shift + tok_shift) * 2);
    }
  }

  // (The row split's query fragments, qa: kRegIO loaded them above.)
  if constexpr (C::kQInRegs && !kRegIO) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) Ldsm4(qa[ks], q_addr + ks * 32);
    if constexpr (D % 16 == 8) Ldsm2(qa_tail, q_addr + (D / 16) * 32);
  }
  if constexpr (kQInStage) {
    // The query rows were staged in the last stage: once every warp has them in
    // registers, that stage's first copies (the async proxy's writes after
    // these reads).
    FenceProxyAsyncShared();
    __syncthreads();
    if (warp == 0 && kStages - 1 < ntiles) issue(kStages - 1, kStages - 1, last_first_entry);
  }
#ifdef JAX_PAGED_TRACE
  if (unsigned long long* row = trace_row()) row[11] = GlobalTimerNs();
#endif

  // wgmma (64-row CTAs, kWgmma): the pages as the tensor cores' B operands, read
  // in place through descriptors (wgmma.cuh). Q.K: per 32 tokens and 16 dims,
  // K-major without swizzle: a core matrix is 8 tokens x 8 dims, 128 contiguous
  // bytes of a K page ([D/8][BS][8]); the next 8 dims are BS * 16 bytes on, and
  // the product's four 8-token groups one stride apart: 128 bytes (a 32-token
  // page), or a page (8-token pages: pages 4s..4s+3; 16-token pages: tokens
  // 8s..8s+7 of each of the tile's four pages, so that product s holds n-tiles
  // sw[0..3][s] instead of sw[2s..2s+1][0..1]). P.V: per 16 tokens
  // and up to 64 dims, K-major (tokens) rows of the V page ([D][BS]), BS * 2 bytes
  // per dim: 8-token pages are that layout without swizzle (the next 8 tokens are
  // the next page); 16- and 32-token pages are it with 32- and 64-byte swizzle,
  // which the V pages' tensor copies (issue, v_map) write, so that no pass
  // swizzles V in place.
  // wg_k_off / wg_v_off: byte offsets of tile tokens 16 h.. in a stage's K / V.
  // wg_k_off[s]: of Q.K product s's first token.
  uint32_t wg_k_off[2] = {}, wg_v_off[kSub] = {};
  uint64_t k_desc = 0, v_desc = 0;
  if constexpr (kWgmma) {
#pragma unroll
    for (int h = 0; h < kSub; ++h) {
      const int tok = 16 * h;
      const uint32_t page_off = static_cast<uint32_t>((tok >> log2_bs) * page_elems) * 2u;
      wg_v_off[h] = Opaque(page_off + static_cast<uint32_t>(tok & (BS - 1)) * 2u);
    }
#pragma unroll
    for (int sp = 0; sp < 2; ++sp)
      wg_k_off[sp] = Opaque(BS == 16 ? 128u * sp : static_cast<uint32_t>((32 * sp) >> log2_bs) * page_bytes);
    k_desc = SmemDescriptor(16u * BS, BS == 32 ? 128u : page_bytes, SmemSwizzle::kNone);
    v_desc = BS == 8 ? SmemDescriptor(page_bytes, 128u, SmemSwizzle::kNone)
                     : (BS == 16 ? SmemDescriptor(16u, 256u, SmemSwizzle::k32B)
                                 : SmemDescriptor(16u, 512u, SmemSwizzle::k64B));
  }
  // V's tokens without data in stage st zeroed (P is 0 there, but 0 * NaN is NaN;
  // pages not copied hold a previous tile's or never-written bytes). The tensor copy
  // laid each row (page, dim: BS tokens) out swizzled: 16-token pages hold token
  // chunk c (8 tokens, 16 bytes) of row d at chunk c ^ ((d >> 2) & 1) (32-byte
  // swizzle: address bit 4 ^= bit 7), 32-token pages at c ^ ((d >> 1) & 3) (64-byte
  // swizzle: bits 4-5 ^= bits 7-8), 8-token pages in place. For tiles with such
  // tokens only (data_bits not full: a partition's last tile, as a rule); all
  // threads; the caller fences.
  auto zero_v_without_data = [&](int st, Mask data_bits) {
    unsigned char* vrows =
        smem + static_cast<size_t>(st) * C::kStageBytes + C::kTileElems * sizeof(TC);
    const int chunks = BS >> 3;  // 16-byte chunks (8 tokens) per row
    for (int r = tid; r < ppt * D; r += kCtaThreads) {
      const int page = r / D;
      const int d = r - page * D;
      const int swz = BS == 16 ? (d >> 2) & 1 : (BS == 32 ? (d >> 1) & 3 : 0);
      uint4* row = reinterpret_cast<uint4*>(vrows + (page * page_elems + d * BS) * 2);
      const uint32_t bits = static_cast<uint32_t>(data_bits >> (page * BS));
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // stored chunk j holds the tokens of chunk j ^ swz
        if (j >= chunks) continue;
        const uint32_t b = bits >> (8 * (j ^ swz));
        uint4 c = row[j];
        c.x &= ((b & 1u) ? 0x0000FFFFu : 0u) | ((b & 2u) ? 0xFFFF0000u : 0u);
        c.y &= ((b & 4u) ? 0x0000FFFFu : 0u) | ((b & 8u) ? 0xFFFF0000u : 0u);
        c.z &= ((b & 16u) ? 0x0000FFFFu : 0u) | ((b & 32u) ? 0xFFFF0000u : 0u);
        c.w &= ((b & 64u) ? 0x0000FFFFu : 0u) | ((b & 128u) ? 0xFFFF0000u : 0u);
        row[j] = c;
      }
    }
  };

  // ---- main loop over the partition's tiles -----------------------------------------
  // Tokens of the warp's sub-slices in tile kk (stage st, arrived) that hold data
  // (bit 16 h + j: token tbase + kSubStride * h + j): before L, in a page that was
  // copied.
  auto tile_mask = [&](int kk, int st) -> Mask {
    const uint32_t pages = mask_s[st];
    const int tb = ((start_blk + kk * ppt) << log2_bs) + slice_tok_r;
#ifndef JAX_PAGED_PROBE_NO_COMPUTE
    if constexpr (kRowSplit) {
      // Every page of the tile copied and its last token before L (all but a
      // partition's last tile, as a rule): every token holds data, without the
      // per-sub-slice arithmetic below (~60 instructions per tile).
      if (pages == FirstBits<32>(ppt) && ((start_blk + (kk + 1) * ppt) << log2_bs) <= L)
        return kFullMask;
    }
#endif
    Mask m;
    if constexpr (kRowSplit) {
      m = 0u;
#pragma unroll
      for (int h = 0; h < kSub; ++h)
        m |= static_cast<Mask>(FirstBits<16>(L - (tb + kSubStride * h))) << (16 * h);
    } else {
      m = FirstBits<kSliceTokens>(L - tb);  // contiguous sub-slices
      // (A plain step's window: no token before its first, first_range.start;
      // without one the start is 0 and this clears nothing.)
      if constexpr (kPlain) m &= ~FirstBits<kSliceTokens>(first_range.start - tb);
    }
    Mask page_bits = 0u;
#pragma unroll
    for (int q = 0; q < 2 * kSub; ++q)
      page_bits |= ((pages >> pg[q]) & 1u) ? (static_cast<Mask>(0xFFu) << (8 * q)) : Mask{0};
#ifdef JAX_PAGED_PROBE_NO_COMPUTE
    // Timing probe (development, wrong results): the pipeline without its arithmetic.
    page_bits = 0u;
#endif
    return m & page_bits;
  };

  // wgmma: S = Q K^T of the tile in stage st (arrived, with data) issued into
  // s_next; zero_v_without_data then clears V where the tile has no data. The
  // kernel issues tile k + 1's products before tile k's softmax, so that the tensor cores
  // compute them while the CUDA cores work (S double-buffered: sw, s_next).
  float s_next[kWgmma ? kSub : 1][2][4];
  auto issue_qk = [&](int st, float (&dst)[kWgmma ? kSub : 1][2][4]) {
    if constexpr (kWgmma) {
      const uint32_t kb = stages_addr + static_cast<uint32_t>(st) * C::kStageBytes;
      WgmmaFence();  // (dst was read by ordinary instructions)
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
        for (int sp = 0; sp < 2; ++sp) {
          const uint64_t desc = WithStart(k_desc, kb + wg_k_off[sp] + ks * 32u * BS);
          // 16-token pages: product sp = tokens 8 sp.. of each page (see wg_k_off).
          constexpr bool kInterleaved = kBlockSize == 16;
          auto& t0 = kInterleaved ? dst[0][sp] : dst[2 * sp][0];
          auto& t1 = kInterleaved ? dst[1][sp] : dst[2 * sp][1];
          auto& t2 = kInterleaved ? dst[2][sp] : dst[2 * sp + 1][0];
          auto& t3 = kInterleaved ? dst[3][sp] : dst[2 * sp + 1][1];
          if (ks == 0)
            WgmmaN32<TM, false>(t0, t1, t2, t3, qa[ks], desc);
          else
            WgmmaN32<TM, true>(t0, t1, t2, t3, qa[ks], desc);
        }
      WgmmaCommit();
    }
  };

  // O *= a: row gid by a[0], row gid + 8 by a[1] (not computed with kHalfRows).
  auto scale_o = [&](const float (&a)[2]) {
#pragma unroll
    for (int n = 0; n < C::kNTiles; ++n) {
      o[n][0] *= a[0];
      o[n][1] *= a[0];
      if constexpr (!kHalfRows) {
        o[n][2] *= a[1];
        o[n][3] *= a[1];
      }
    }
  };
  // wgmma: O (64 rows x D) += P V of a tile, P's A fragments pa, its
  // stage's V at vb; 16 tokens x up to 64 dims per product (V's tokens without data
  // were zeroed by zero_v_without_data).
  auto issue_pv = [&](const uint32_t (&pa)[kSub][4], uint32_t vb) {
    if constexpr (kWgmma) {
      WgmmaFence();
#pragma unroll
      for (int h = 0; h < kSub; ++h)
        WgmmaAccAll<TM, 0>(o, pa[h], [&](int d0) {
          return WithStart(v_desc, vb + wg_v_off[h] + static_cast<uint32_t>(d0 * BS) * 2u);
        });
      WgmmaCommit();
    }
  };

  int stage = 0;
  uint32_t phase = 0;
  Mask next_mask = 0u;  // wgmma: tile k's mask, from iteration k - 1 (or the prologue)
  // kDeferPv: the previous tile's P (A fragments), its rows' rescale factors and its
  // stage's V address, when it has a P.V still to issue (pv_ready).
  uint32_t pv_pa[kSub][4];
  float pv_alpha[2] = {1.0f, 1.0f};
  uint32_t pv_vbase = 0;
  bool pv_ready = false;
  // O *= pv_alpha, then O += P V of the tile whose P is pv_pa.
  auto deferred_pv = [&] {
    if (__any_sync(0xffffffffu, pv_alpha[0] != 1.0f || pv_alpha[1] != 1.0f)) scale_o(pv_alpha);
    issue_pv(pv_pa, pv_vbase);
  };
  if constexpr (kWgmma) {
    MbarWait(bar0, 0u);
    next_mask = tile_mask(0, 0);
    if (next_mask != 0u) issue_qk(0, s_next);
    if (next_mask != 0u && next_mask != kFullMask) {  // (CTA-uniform)
      zero_v_without_data(0, next_mask);
      FenceProxyAsyncShared();  // the zeros, before the tensor cores read V
    }
    __syncthreads();
    WgmmaWaitAll();
  }
  for (int k = 0; k < ntiles; ++k) {
    Mask smask;
    if constexpr (kWgmma) {
      smask = next_mask;
    } else {
      MbarWait(bar0 + 8 * stage, phase);
      smask = tile_mask(k, stage);
    }
#ifdef JAX_PAGED_TRACE
    if (k == 0) {
      if (unsigned long long* row = trace_row()) row[1] = GlobalTimerNs();
    }
#endif
    const int tile_tok0 = (start_blk + k * ppt) << log2_bs;
    const int tbase = tile_tok0 + slice_tok_r;  // the warp's first token of the tile
    // wgmma: tile k + 1 (waited for here), its Q.K issued before tile k's softmax.
    const int next_stage = stage + 1 == kStages ? 0 : stage + 1;
    if constexpr (kDeferPv) {
      if (pv_ready) deferred_pv();  // tile k - 1's P.V, running while tile k's softmax computes
    }
    if constexpr (kWgmma) {
      next_mask = 0u;
      if (k + 1 < ntiles) {
        MbarWait(bar0 + 8 * next_stage, next_stage == 0 ? phase ^ 1u : phase);
        next_mask = tile_mask(k + 1, next_stage);
      }
    }
    // kDeferPv: tile k's S out of s_next, then tile k + 1's Q.K issued at this one place
    // every tile, also when tile k + 1 has no data or does not exist (its S is then
    // never read; the stage's bytes are stale, never written meanwhile): a Q.K issued
    // under a condition made the compiler copy the old S into the product's registers
    // ahead of the branch, while tile k - 1's P.V ran, and ptxas then serialized
    // every product (C7515).
    float s_cur[kDeferPv ? kSub : 1][2][4];
    if constexpr (kDeferPv) {
      if (smask != 0u) {
#pragma unroll
        for (int h = 0; h < kSub; ++h)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s_cur[h][nt][e] = s_next[h][nt][e];
      }
      issue_qk(next_stage, s_next);
    }
    // (Row split: a warp whose row block is past the CTA's rows computes nothing.)
    // (wgmma: every warp of the warpgroup takes part; smask is CTA-uniform there.)
    if (smask != 0u && (kWgmma || !kRowSplit || rows > rb * kMaxRows)) {  // warp-uniform
      const uint32_t kbase = stages_addr + static_cast<uint32_t>(stage) * C::kStageBytes;
      const uint32_t vbase = kbase + C::kTileElems * sizeof(TC);
      const unsigned char* kptr = smem + static_cast<size_t>(stage) * C::kStageBytes;
      const unsigned char* vptr = kptr + C::kTileElems * sizeof(TC);

      // S fragments: sw[h][nt][e] = q[row gid + 8 (e >> 1)] . k[token 16 h +
      // token_of(nt, e)] (h: sub-slice; only fp8 caches have more than one).
      float sw[kSub][2][4];
      if constexpr (!kWgmma) {  // (wgmma's first product overwrites)
#pragma unroll
        for (int h = 0; h < kSub; ++h)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
            sw[h][nt][0] = sw[h][nt][1] = sw[h][nt][2] = sw[h][nt][3] = 0.0f;
      }
      auto& s = sw[0];  // the 16-bit and f32 paths' only sub-slice
      if constexpr (kWgmma) {
        // S of tile k (computed during tile k - 1's softmax), then tile k + 1's.
#pragma unroll
        for (int h = 0; h < kSub; ++h)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              sw[h][nt][e] = kDeferPv ? s_cur[h][nt][e] : s_next[h][nt][e];
        if (!kDeferPv && next_mask != 0u) issue_qk(next_stage, s_next);
      } else if constexpr (kFp8) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          uint32_t a[4];  // shared by the sub-slices
          if constexpr (C::kQInRegs) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = qa[ks][i];
          } else {
            Ldsm4(a, q_addr + ks * 32);
          }
#pragma unroll
          for (int h = 0; h < kSub; ++h)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              const uint32_t raw =
                  *reinterpret_cast<const uint32_t*>(kptr + k8_off[h] + nt * 32 + ks * 16 * BS);
              uint32_t b0, b1;
              Fp8x4ToHalf2x2<TC>(raw, b0, b1);
              Mma16816<TM>(sw[h][nt], a, b0, b1);
            }
        }
      } else if constexpr (C::kMma) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          uint32_t a[4];
          if constexpr (C::kQInRegs) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = qa[ks][i];
          } else {
            Ldsm4(a, q_addr + ks * 32);
          }
#pragma unroll
          for (int h = 0; h < kSub; ++h) {
            uint32_t b[4];
            Ldsm4(b, kbase + k_off_h[h] + ks * 32 * BS);
            Mma16816<TM>(sw[h][0], a, b[0], b[1]);
            Mma16816<TM>(sw[h][1], a, b[2], b[3]);
          }
        }
        if constexpr (D % 16 == 8) {
          uint32_t a[2];
          if constexpr (C::kQInRegs) {
            a[0] = qa_tail[0];
            a[1] = qa_tail[1];
          } else {
            Ldsm2(a, q_addr + (D / 16) * 32);
          }
#pragma unroll
          for (int h = 0; h < kSub; ++h) {
            uint32_t b[2];
            Ldsm2(b, kbase + k_tail_off_h[h]);
            Mma1688<TM>(sw[h][0], a, b[0]);
            Mma1688<TM>(sw[h][1], a, b[1]);
          }
        }
      } else {
        const float* qf = reinterpret_cast<const float*>(q_s);
        const float* kf = reinterpret_cast<const float*>(kptr);
        auto qk = [&](auto two_rows) {
#pragma unroll 4
          for (int c = 0; c < D / 4; ++c) {
            const float4 q0 = *reinterpret_cast<const float4*>(qf + gid * C::kQStride + c * 4);
            float4 q1 = make_float4(0.f, 0.f, 0.f, 0.f);
            if constexpr (decltype(two_rows)::value)
              q1 = *reinterpret_cast<const float4*>(qf + (gid + 8) * C::kQStride + c * 4);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float4 kv = *reinterpret_cast<const float4*>(kf + kf_off[nt][e] + c * BS * 4);
                s[nt][e] = Dot4(q0, kv, s[nt][e]);
                if constexpr (decltype(two_rows)::value) s[nt][2 + e] = Dot4(q1, kv, s[nt][2 + e]);
              }
          }
        };
        if (rows > 8)
          qk(std::true_type{});
        else
          qk(std::false_type{});
      }

      // Logits (log2 units) and the online softmax over this slice's tokens.
      float mx[2] = {-INFINITY, -INFINITY};
      // kAllValid (row split): every token of the pass holds data and lies in every
      // row's range, and there is no ALiBi: no per-token test (the general one cost
      // ~20 integer instructions per logit, most of the row split's instructions).
      // kCapped: the soft cap, as a compile-time choice per tile (a run-time test
      // per logit compiled to 32 branches per tile around each tanh).
      auto logits = [&](auto kAllValid, auto kCapped) {
#pragma unroll
        for (int h = 0; h < kSub; ++h)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if ((e >> 1) >= kFragRows) continue;
              const int j = 16 * h + token_of(nt, e);  // bit of smask
              const int r = e >> 1;
              const int t = tbase + (kRowSplit ? kSubStride * h + token_of(nt, e) : j);
              float l = -INFINITY;
              if constexpr (kPlain) {
                if (decltype(kAllValid)::value || ((smask >> j) & 1u)) {
                  l = sw[h][nt][e] * qk_scale;
                  if constexpr (kCap) l = cap2 * FastTanh(l * cap_inv);
                }
              } else if constexpr (decltype(kAllValid)::value) {
                l = sw[h][nt][e] * qk_scale;
                if constexpr (decltype(kCapped)::value) l = cap2 * FastTanh(l * cap_inv);
              } else {
                if (((smask >> j) & 1u) && t >= r_start[r] && t < r_end[r]) {
                  l = fmaf(sw[h][nt][e], qk_scale, slope[r] * static_cast<float>(t - (r_end[r] - 1)));
                  if constexpr (decltype(kCapped)::value) l = cap2 * FastTanh(l * cap_inv);
                }
              }
              sw[h][nt][e] = l;
              if constexpr (!kRowSplit) mx[r] = fmaxf(mx[r], l);
            }
      };
      // (The plain step's cap is its template's kCap; smask, tbase, the bounds and
      // the cap are warp-uniform.)
      auto capped_logits = [&](auto kAllValid) {
        if constexpr (kPlain)
          logits(kAllValid, std::bool_constant<kCap>{});
        else if (soft_cap > 0.0f)
          logits(kAllValid, std::true_type{});
        else
          logits(kAllValid, std::false_type{});
      };
      if constexpr (kRowSplit) {
        if (smask == kFullMask && tbase >= all_valid_lo && tbase <= all_valid_hi)
          capped_logits(std::true_type{});
        else
          capped_logits(std::false_type{});
      } else {
        capped_logits(std::false_type{});
      }
      if constexpr (kRowSplit) {
        // Each row's maximum over the pass's 4 * kSub logits of this lane as a
        // tree (depth log2, not a chain of dependent fmaxf). Spelled out with
        // constant indices: a loop of halving width put its array in local memory.
        static_assert(kSub == 2 || kSub == 4, "row split: 2 or 4 slices per pass");
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float a[kSub];
#pragma unroll
          for (int h = 0; h < kSub; ++h)
            a[h] = fmaxf(fmaxf(sw[h][0][2 * r], sw[h][0][2 * r + 1]),
                         fmaxf(sw[h][1][2 * r], sw[h][1][2 * r + 1]));
          if constexpr (kSub == 4) {
            a[0] = fmaxf(a[0], a[2]);
            a[1] = fmaxf(a[1], a[3]);
          }
          mx[r] = fmaxf(a[0], a[1]);
        }
      }
      float alpha[2];
#pragma unroll
      for (int r = 0; r < kFragRows; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      }
      // The mma row split keeps a row's running maximum until a pass exceeds it
      // by more than kLazyRescale (log2 units), so that the O rescale (2 * D / 8
      // multiplies) runs a few times per row instead of in most passes. Exact:
      // m_run, l_run and O always refer to the same maximum, and the
      // probabilities stay <= 2^kLazyRescale (fp32 sums, P rounded to 16 bits
      // with the same relative error).
      constexpr bool kLazy = kRowSplit && !kWgmma;
      auto rescale_o = [&] { scale_o(alpha); };
      bool rescale = true;
      if constexpr (kLazy)
        rescale = __any_sync(0xffffffffu, mx[0] > m_run[0] + kLazyRescale ||
                                              mx[1] > m_run[1] + kLazyRescale);  // warp-uniform
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        alpha[r] = 1.0f;
        if (rescale && r < kFragRows) {
          const float m_new = fmaxf(m_run[r], mx[r]);
          alpha[r] = Exp2Ftz(m_run[r] - m_new);
          m_run[r] = m_new;
          l_run[r] *= alpha[r];
        }
      }
      if constexpr (kLazy) {
        if (rescale) rescale_o();
      }
#pragma unroll
      for (int h = 0; h < kSub; ++h)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if ((e >> 1) < kFragRows) sw[h][nt][e] = Exp2Ftz(sw[h][nt][e] - m_run[e >> 1]);
      // (wgmma: tile k + 1's Q.K done before O is touched: ptxas serializes every
      // wgmma of a kernel where ordinary instructions use accumulators while
      // products are in flight, warning C7514.)
      if constexpr (kWgmma && !kDeferPv) WgmmaWaitAll();
      // alpha is exactly 1 for a row whose maximum did not grow (2^0): the
      // fp8 path, bound by instruction issue, skips the multiplies when no
      // row of the warp needs them, and so does the wgmma row split (the
      // mma.sync one rescales lazily, above).
      if constexpr (kDeferPv) {
        pv_alpha[0] = alpha[0];  // (applied before this tile's P.V, at the next tile)
        pv_alpha[1] = alpha[1];
      } else if constexpr (!kLazy) {
        if (!(kFp8 || kRowSplit) ||
            __any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f))  // warp-uniform
          rescale_o();
      }

      // O += P V. Tokens without data (smask) have their V zeroed in registers:
      // their P is 0, but 0 * NaN would still poison O.
      if constexpr (kDeferPv) {
        // The softmax sums now; P's fragments once the previous tile's P.V (which
        // reads pv_pa) is done; its P.V at the next tile.
#pragma unroll
        for (int h = 0; h < kSub; ++h) {
          l_run[0] += (sw[h][0][0] + sw[h][0][1]) + (sw[h][1][0] + sw[h][1][1]);
          l_run[1] += (sw[h][0][2] + sw[h][0][3]) + (sw[h][1][2] + sw[h][1][3]);
        }
        WgmmaWaitAll();
#pragma unroll
        for (int h = 0; h < kSub; ++h) {
          pv_pa[h][0] = PackPair<TM>(sw[h][0][0], sw[h][0][1]);
          pv_pa[h][1] = PackPair<TM>(sw[h][0][2], sw[h][0][3]);
          pv_pa[h][2] = PackPair<TM>(sw[h][1][0], sw[h][1][1]);
          pv_pa[h][3] = PackPair<TM>(sw[h][1][2], sw[h][1][3]);
        }
        pv_vbase = vbase;
      } else if constexpr (C::kMma) {
        // A fragment of P (rows, k = the slice's tokens), rounded to T; the
        // softmax sum adds the unrounded fp32 values, so that lse (and the
        // split weights) are fp32-accurate, as in the classic kernels.
        uint32_t paw[kSub][4];
#pragma unroll
        for (int h = 0; h < kSub; ++h) {
          paw[h][0] = PackPair<TM>(sw[h][0][0], sw[h][0][1]);
          paw[h][2] = PackPair<TM>(sw[h][1][0], sw[h][1][1]);
          l_run[0] += (sw[h][0][0] + sw[h][0][1]) + (sw[h][1][0] + sw[h][1][1]);
          if constexpr (kHalfRows) {
            paw[h][1] = paw[h][3] = 0u;
          } else {
            paw[h][1] = PackPair<TM>(sw[h][0][2], sw[h][0][3]);
            paw[h][3] = PackPair<TM>(sw[h][1][2], sw[h][1][3]);
            l_run[1] += (sw[h][0][2] + sw[h][0][3]) + (sw[h][1][2] + sw[h][1][3]);
          }
        }
        const uint32_t (&pa)[4] = paw[0];  // the 16-bit path's only sub-slice
        // Two copies of the loop, so that full slices (all but a partition's
        // last) test nothing per n-tile (a per-tile test cost 4 branch
        // instructions per n-tile in the fp8 SASS).
        const bool masked = smask != kFullMask;
        if constexpr (kWgmma) {
          issue_pv(paw, vbase);
        } else if constexpr (kFp8) {
          // b0 = tokens 4tq, 4tq+1, b1 = tokens 4tq+2, 4tq+3 (of sub-slice h)
          // of dim gid.
          auto pv8 = [&](auto kMasked) {
            uint32_t byte_mask[kSub];
#pragma unroll
            for (int h = 0; h < kSub; ++h)
              byte_mask[h] = decltype(kMasked)::value
                                 ? ByteMask((smask >> (16 * h + 4 * tq)) & 0xFu)
                                 : 0xFFFFFFFFu;
#pragma unroll
            for (int n = 0; n < C::kNTiles; ++n)
#pragma unroll
              for (int h = 0; h < kSub; ++h) {
                uint32_t raw = *reinterpret_cast<const uint32_t*>(vptr + v8_off[h] + n * 8 * BS);
                if constexpr (decltype(kMasked)::value) raw &= byte_mask[h];
                uint32_t b0, b1;
                Fp8x4ToHalf2x2<TC>(raw, b0, b1);
                Mma16816<TM>(o[n], paw[h], b0, b1);
              }
          };
          if (masked)
            pv8(std::true_type{});
          else
            pv8(std::false_type{});
        } else {
          // V fragment b0 holds tokens 2tq, 2tq+1; b1 tokens 2tq+8, 2tq+9 (of
          // sub-slice h).
          uint32_t vm0[kSub], vm1[kSub];
          auto value_masks = [&] {
#pragma unroll
            for (int h = 0; h < kSub; ++h) {
              const uint32_t hm = static_cast<uint32_t>(smask >> (16 * h));
              vm0[h] = (((hm >> (2 * tq)) & 1u) ? 0x0000FFFFu : 0u) |
                       (((hm >> (2 * tq + 1)) & 1u) ? 0xFFFF0000u : 0u);
              vm1[h] = (((hm >> (2 * tq + 8)) & 1u) ? 0x0000FFFFu : 0u) |
                       (((hm >> (2 * tq + 9)) & 1u) ? 0xFFFF0000u : 0u);
            }
          };
          if constexpr (!kRowSplit) value_masks();  // (the row split: only when masked)
          auto pv16 = [&](auto kMasked) {
            constexpr bool kM = decltype(kMasked)::value;
            if constexpr (kRowSplit && kM) value_masks();
            // Sub-slice-major for the row split: consecutive products accumulate
            // into different O n-tiles (np-major, each n-tile's kSub products
            // would be two apart, a chain of dependent mma).
            constexpr int kPairs = C::kNTiles / 2;
#pragma unroll
            for (int i = 0; i < kPairs * kSub; ++i) {
              const int np = kRowSplit ? i % kPairs : i / kSub;
              const int h = kRowSplit ? i / kPairs : i % kSub;
              uint32_t b[4];
              Ldsm4(b, vbase + v_off_h[h] + np * 32 * BS);
              if constexpr (kRowSplit) {
                UnswapPair(b[0], b[1], v_swap);
                UnswapPair(b[2], b[3], v_swap);
              }
              if constexpr (kM) {
                b[0] &= vm0[h];
                b[1] &= vm1[h];
                b[2] &= vm0[h];
                b[3] &= vm1[h];
              }
              Mma16816<TM>(o[2 * np], paw[h], b[0], b[1]);
              Mma16816<TM>(o[2 * np + 1], paw[h], b[2], b[3]);
            }
            if constexpr (C::kNTiles % 2 == 1) {
#pragma unroll
              for (int h = 0; h < kSub; ++h) {
                uint32_t b[2];
                Ldsm2(b, vbase + v_off_h[h] + (C::kNTiles / 2) * 32 * BS);
                if constexpr (kRowSplit) UnswapPair(b[0], b[1], v_swap);
                if constexpr (kM) {
                  b[0] &= vm0[h];
                  b[1] &= vm1[h];
                }
                Mma16816<TM>(o[C::kNTiles - 1], paw[h], b[0], b[1]);
              }
            }
          };
          if (masked)
            pv16(std::true_type{});
          else
            pv16(std::false_type{});
        }
      } else {
        // Gather the slice's probabilities of rows gid, gid + 8 from the quad.
        float pr[2][16];
#pragma unroll
        for (int src = 0; src < 4; ++src)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              pr[e >> 1][nt * 8 + 2 * src + (e & 1)] =
                  __shfl_sync(0xffffffffu, s[nt][e], (lane & ~3) | src);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          l_run[0] += s[nt][0] + s[nt][1];
          l_run[1] += s[nt][2] + s[nt][3];
        }
        const float* vf = reinterpret_cast<const float*>(vptr);
        auto pv = [&](auto two_rows) {
#pragma unroll
          for (int j4 = 0; j4 < 4; ++j4) {
            const uint32_t bits = (smask >> (4 * j4)) & 0xFu;
            if (bits == 0u) continue;  // warp-uniform
            const int tv = slice_tok + 4 * j4;
            const float* vrow = vf + (tv >> log2_bs) * page_elems + (tv & (BS - 1));
#pragma unroll
            for (int n = 0; n < C::kNTiles; ++n) {
              const int d = dim0 + n * 8 + 2 * tq;
              float4 va = *reinterpret_cast<const float4*>(vrow + d * BS);
              float4 vb = *reinterpret_cast<const float4*>(vrow + (d + 1) * BS);
              if (bits != 0xFu) {  // zero masked tokens' values (NaN-safe)
                va.x = (bits & 1u) ? va.x : 0.f;
                va.y = (bits & 2u) ? va.y : 0.f;
                va.z = (bits & 4u) ? va.z : 0.f;
                va.w = (bits & 8u) ? va.w : 0.f;
                vb.x = (bits & 1u) ? vb.x : 0.f;
                vb.y = (bits & 2u) ? vb.y : 0.f;
                vb.z = (bits & 4u) ? vb.z : 0.f;
                vb.w = (bits & 8u) ? vb.w : 0.f;
              }
              const float4 p0 = make_float4(pr[0][4 * j4], pr[0][4 * j4 + 1], pr[0][4 * j4 + 2],
                                            pr[0][4 * j4 + 3]);
              o[n][0] = Dot4(p0, va, o[n][0]);
              o[n][1] = Dot4(p0, vb, o[n][1]);
              if constexpr (decltype(two_rows)::value) {
                const float4 p1 = make_float4(pr[1][4 * j4], pr[1][4 * j4 + 1],
                                              pr[1][4 * j4 + 2], pr[1][4 * j4 + 3]);
                o[n][2] = Dot4(p1, va, o[n][2]);
                o[n][3] = Dot4(p1, vb, o[n][3]);
              }
            }
          }
        };
        if (rows > 8)
          pv(std::true_type{});
        else
          pv(std::false_type{});
      }
    }

    if constexpr (kWgmma) {
      // Tile k + 1's Q.K (if not issued above: tile k had nothing to compute) and
      // V's tokens without data; then every product in flight done (this stage's
      // P.V before its refill).
      if (!kDeferPv && smask == 0u && next_mask != 0u) issue_qk(next_stage, s_next);
      if (next_mask != 0u && next_mask != kFullMask) {  // (CTA-uniform)
        zero_v_without_data(next_stage, next_mask);
        FenceProxyAsyncShared();
      }
      WgmmaWaitAll();
      if constexpr (kDeferPv) pv_ready = smask != 0u;
    }
    // Every warp done with this stage: the decode kernels' last warp to release
    // it refills it at once, and nobody waits (a warp 0 that waited there for the
    // others, as the producer, was tied to the slowest warp). The row split keeps
    // a CTA barrier per tile, warp 0 refilling: its 64 rows' warps then run their
    // products and softmax in step, which beat barrier-free releases. So does the
    // wgmma form (its warpgroup zeroes V's tokens without data in place between
    // the products).
    constexpr bool kCtaBarrier = kWgmma || kRowSplit;
    if (pending_stage >= 0) {  // the table entries of this warp's last refill
      if (lane < C::kMaxTilePages)
        refill_table_s[pending_stage * C::kMaxTilePages + lane] = pending_entry;
      pending_stage = -1;
    }
    bool refill;
    if constexpr (kCtaBarrier) {
      __syncthreads();
      refill = warp == 0;
    } else {
      // The warp's reads of the stage and its table stores, then lane 0's release
      // (fence + count); the last warp's acquire (count + fence) orders them
      // before its refill and its reads of the table.
      __syncwarp();
      uint32_t released = 0u;
      if (lane == 0) {
        __threadfence_block();
        released = atomicAdd(release_count_s + stage, 1u) + 1u;
      }
      refill = __shfl_sync(0xffffffffu, released, 0) == static_cast<uint32_t>(kWarps);
      if (refill) {
        __threadfence_block();
        if (lane == 0) release_count_s[stage] = 0u;  // before the refill's arrival (release)
      }
    }
    // The tile released here and its stage: this one, or with kDeferPv the one before
    // (whose P.V ran in this iteration).
    const int rel_tile = kDeferPv ? k - 1 : k;
    const int rel_stage = kDeferPv ? (stage == 0 ? kStages - 1 : stage - 1) : stage;
    if (refill && rel_tile >= 0 && rel_tile + kStages < ntiles) {
      issue(rel_tile + kStages, rel_stage,
            lane < C::kMaxTilePages ? refill_table_s[rel_stage * C::kMaxTilePages + lane] : -1);
      if (rel_tile + 2 * kStages < ntiles) {
        pending_entry = load_entry(rel_tile + 2 * kStages);
        pending_stage = rel_stage;
      }
    }
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }

  if constexpr (kDeferPv) {  // the last tile's P.V
    if (pv_ready) deferred_pv();
    WgmmaWaitAll();
  }
#ifdef JAX_PAGED_TRACE
  t_loop_end = GlobalTimerNs();
  c_loop_end = clock64();
#endif
  // ---- merge the slices (exact rescaling), normalise, write ---------------------------
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  if constexpr (kRegIO) {
    // One slice group (each warp holds whole rows: kMergeSlices == 1), so each
    // lane normalises and writes its own fragments (rows gid, gid + 8 of its row
    // block; dims 8 n + 2 tq, + 1): no merge buffer, no CTA barrier. The same
    // arithmetic as the merge below with one slice (its factor exp2(m - m) is 1).
    static_assert(C::kMergeSlices == 1 && C::kNTiles * 8 == D, "kRegIO: one slice group");
#ifdef JAX_PAGED_TRACE
    t_all_loops = t_merged = GlobalTimerNs();  // (no merge: the output stores start here)
#endif
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int lr = rb * kMaxRows + gid + 8 * r;
      if (lr >= rows) continue;
      const float m_all = m_run[r];
      const float l_all = l_run[r];
      const float factor = v_scale / (l_all + 1e-6f);
      const int64_t hrow = hrow_of(lr);
      const float m_nat = m_all == -FLT_MAX ? -FLT_MAX : m_all * kLn2;  // (log2 units)
      if (direct_out) {
        const float w = l_all / (l_all + 1e-6f);  // V2's reduce of one partition
        T* out = static_cast<T*>(p.out) + hrow * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < C::kNTiles; ++n)
          *reinterpret_cast<uint32_t*>(out + 8 * n) =
              PackPair<T>(o[n][2 * r] * factor * w, o[n][2 * r + 1] * factor * w);
        if (tq == 0 && p.lse != nullptr) p.lse[hrow] = LogSumExp(m_nat, l_all);
      } else {
        float* dst = p.tmp_out + (hrow * P + part) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < C::kNTiles; ++n)
          *reinterpret_cast<float2*>(dst + 8 * n) =
              make_float2(o[n][2 * r] * factor, o[n][2 * r + 1] * factor);
        if (tq == 0) {
          p.max_logits[hrow * P + part] = m_nat;
          p.exp_sums[hrow * P + part] = l_all;
        }
      }
    }
  } else {
  if (dsub == 0 && tq == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = rb * kMaxRows + gid + 8 * r;
      ml_s[(slice * C::kRows + row) * 2] = m_run[r];
      ml_s[(slice * C::kRows + row) * 2 + 1] = l_run[r];
    }
  }
  __syncthreads();  // (the stages are free: every copy was consumed)
#ifdef JAX_PAGED_TRACE
  t_all_loops = GlobalTimerNs();
#endif
  constexpr int kOS = C::kObufStride;  // padded rows (see GroupedConfig)
  float* obuf = reinterpret_cast<float*>(smem);  // [kMergeSlices][kRows][kOS]
  // Row r's max over the slices (log2 units).
  auto row_max = [&](int r) {
    float m = -FLT_MAX;
#pragma unroll
    for (int sl = 0; sl < C::kMergeSlices; ++sl) m = fmaxf(m, ml_s[(sl * C::kRows + r) * 2]);
    return m;
  };
  // Rows gid + 8 (of the warp's row block) exist only when the CTA has more
  // than 8 there (warp-uniform).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (r == 1 && rows - rb * kMaxRows <= 8) break;
    const int row = rb * kMaxRows + gid + 8 * r;
    const float f = exp2f(m_run[r] - row_max(row));
    float* dst = obuf + (slice * C::kRows + row) * kOS + dim0 + 2 * tq;
#pragma unroll
    for (int n = 0; n < C::kNTiles; ++n)
      *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][2 * r] * f, o[n][2 * r + 1] * f);
  }
  // Each row's max, softmax sum and output factor over the slices, once per
  // row (not once per output element below), in the query's buffer (no
  // longer read; GroupedConfig::kRowStatsOff).
  // The row split also keeps there the single-partition weight w (below), so that
  // its unrolled output loop divides nothing per element.
  float* row_s = reinterpret_cast<float*>(smem + C::kRowStatsOff);  // [kRows][4]: max, sum, factor, w
  if (tid < rows) {
    const float m_all = row_max(tid);
    float l_all = 0.0f;
#pragma unroll
    for (int sl = 0; sl < C::kMergeSlices; ++sl)
      l_all += ml_s[(sl * C::kRows + tid) * 2 + 1] * exp2f(ml_s[(sl * C::kRows + tid) * 2] - m_all);
    row_s[4 * tid] = m_all;
    row_s[4 * tid + 1] = l_all;
    row_s[4 * tid + 2] = v_scale / (l_all + 1e-6f);
    if constexpr (kRowSplit) row_s[4 * tid + 3] = l_all / (l_all + 1e-6f);
  }
  __syncthreads();
#ifdef JAX_PAGED_TRACE
  t_merged = GlobalTimerNs();
#endif
  // Four consecutive dims per thread (D % 8 == 0): one 16-byte workspace store.
  constexpr int kQuads = D / 4;
  // Output quad i (row i / kQuads, dims 4 (i % kQuads)..+3). A macro, not a lambda:
  // a lambda changed the scheduling of some kernels.
#define JAX_PAGED_WRITE_QUAD(i)                                                           \
  {                                                                                       \
    const int r = (i) / kQuads;                                                           \
    const int d = ((i) - r * kQuads) * 4;                                                 \
    const float m_all = row_s[4 * r];                                                     \
    const float l_all = row_s[4 * r + 1];                                                 \
    const float factor = row_s[4 * r + 2];                                                \
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);                                     \
    _Pragma("unroll") for (int sl = 0; sl < C::kMergeSlices; ++sl) {                      \
      const float4 v = *reinterpret_cast<const float4*>(obuf + (sl * C::kRows + r) * kOS + d); \
      acc.x += v.x;                                                                       \
      acc.y += v.y;                                                                       \
      acc.z += v.z;                                                                       \
      acc.w += v.w;                                                                       \
    }                                                                                     \
    const float4 val = make_float4(acc.x * factor, acc.y * factor, acc.z * factor, acc.w * factor); \
    const int64_t hrow = hrow_of(r);                                                      \
    /* m_all is in log2 units (the logits were scaled by log2(e)). */                     \
    const float m_nat = m_all == -FLT_MAX ? -FLT_MAX : m_all * kLn2;                      \
    if (direct_out) {                                                                     \
      /* V2's reduce over one partition: w = s, out = w * tmp / (w + 1e-6). */           \
      const float w = kRowSplit ? row_s[4 * r + 3] : l_all / (l_all + 1e-6f);           \
      T* out = static_cast<T*>(p.out) + hrow * D + d;                                     \
      StoreFour(out, make_float4(val.x * w, val.y * w, val.z * w, val.w * w));            \
      if (d == 0 && p.lse != nullptr) p.lse[hrow] = LogSumExp(m_nat, l_all);              \
    } else {                                                                              \
      *reinterpret_cast<float4*>(p.tmp_out + (hrow * P + part) * D + d) = val;            \
      if (d == 0) {                                                                       \
        p.max_logits[hrow * P + part] = m_nat;                                            \
        p.exp_sums[hrow * P + part] = l_all;                                              \
      }                                                                                   \
    }                                                                                     \
  }
  if constexpr (kRowSplit && C::kCtasPerSm <= 2) {
    // The row split's 32 or 64 rows: 8-16 quads per thread at head 128, unrolled so
    // that their shared-memory loads, row divisions and stores overlap (the run-time
    // loop below makes them one dependent chain per quad), the weight read from row_s.
    // Not at four CTAs per SM: at their 128 registers the unrolled loop spilled
    // (fp8 row split, head 64: 20 bytes in four kernels). (Each quad's bounds check
    // branches around its loads here.)
#pragma unroll
    for (int step = 0; step < (C::kRows * kQuads + kCtaThreads - 1) / kCtaThreads; ++step) {
      const int i = tid + step * kCtaThreads;
      if (i < rows * kQuads) JAX_PAGED_WRITE_QUAD(i)
    }
  } else {
    for (int i = tid; i < rows * kQuads; i += kCtaThreads) JAX_PAGED_WRITE_QUAD(i)
  }
#undef JAX_PAGED_WRITE_QUAD
  }  // (kRegIO)
#ifdef JAX_PAGED_TRACE
  __syncthreads();  // every output of the CTA written
  if (unsigned long long* row = trace_row()) {
    row[2] = t_loop_end;
    row[3] = GlobalTimerNs();
    row[4] = SmId();
    row[5] = static_cast<unsigned long long>(ntiles);
    // SM clock cycles (exact where %globaltimer may tick coarsely): entry ->
    // loop end (row[6] held the entry clock), loop end -> exit.
    row[6] = static_cast<unsigned long long>(c_loop_end) - row[6];
    row[7] = static_cast<unsigned long long>(clock64() - c_loop_end);
    row[8] = t_all_loops;
    row[9] = t_merged;
  }
#endif
#endif  // JAX_PAGED_GROUPED_SM90
}

// One instantiation of the kernel with its own once-per-device flags (shared
// memory limit raised, carveout hint set), its shared memory and rows per CTA.
struct GroupedInstance {
  void (*kernel)(PagedAttentionParams, int, int, int, bool, CUtensorMap);
  std::atomic<bool>* smem_configured;  // [kMaxDevices]
  std::atomic<bool>* carveout_set;     // [kMaxDevices]
  size_t smem_bytes;                   // GroupedConfig::kSmemBytes
  int max_rows;                        // GroupedConfig::kRows
  int threads;                         // GroupedConfig::kCtaThreads
};
template <typename T, typename TC, int D, bool kPlain, int kBlockSize = 0, bool kCap = false,
          int kRowBlocks = 1, bool kWgmma = false, bool kHalfRows = false, int kWarpgroups = 1,
          bool kDeferPv = false, int kFp8Ctas = 0>
GroupedInstance GroupedInstanceOf() {
  using C = GroupedConfig<static_cast<int>(sizeof(T)), static_cast<int>(sizeof(TC)), D, kRowBlocks,
                          kWarpgroups, kFp8Ctas>;
  static std::atomic<bool> smem_configured[kMaxDevices];
  static std::atomic<bool> carveout_set[kMaxDevices];
  return {&GroupedAttentionKernel<T, TC, D, kPlain, kBlockSize, kCap, kRowBlocks, kWgmma, kHalfRows,
                                  kWarpgroups, kDeferPv, kFp8Ctas>,
          smem_configured, carveout_set, static_cast<size_t>(C::kSmemBytes), C::kRows,
          C::kCtaThreads};
}

// Compute capability 9.0 (H100, H200): the one the sm_90a machine code runs on.
inline bool IsSm90(int device) {
  return ComputeCapabilityMajor(device) == 9 && ComputeCapabilityMinor(device) == 0;
}
// Whether the 64-row CTAs run their wgmma form: on compute capability 9.0 unless
// KernelOptions::wgmma is off.
inline bool WgmmaEnabled(int device) { return GetKernelOptions().wgmma && IsSm90(device); }
// Whether a KV head of more than 64 query rows takes the wgmma form's 128-row CTAs (two
// warpgroups over shared stages, one CTA per SM; more than 128 rows in chunks of up to
// 128) instead of 64-row CTAs that each copy every page. Their arithmetic bounds them,
// so each tile's P.V is issued at the next tile (kDeferPv): it and the Q.K after it
// both run over that tile's softmax, where a warpgroup would otherwise wait for its
// P.V with nothing to do.
inline bool Wgmma128Enabled() { return GetKernelOptions().wgmma_128; }

// The driver's cuTensorMapEncodeTiled, found once through the runtime (so that
// nothing links libcuda); nullptr where the driver has none.
using TensorMapEncoder = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                      const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                      const cuuint32_t*, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion,
                                      CUtensorMapFloatOOBfill);
inline TensorMapEncoder DriverTensorMapEncoder() {
  static const TensorMapEncoder encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<TensorMapEncoder>(nullptr);
    }
    return reinterpret_cast<TensorMapEncoder>(fn);
  }();
  return encode;
}

// The wgmma form's tensor map of the value cache (T elements, head size D): a
// 2-D tensor of num_blocks * num_kv_heads * D rows of block_size tokens, whose
// box of D rows is one page of one KV head ([D][BS]), laid out in shared memory
// with the swizzle P.V's operand descriptor reads (32-byte rows of 16-token
// pages: 32-byte swizzle; 64-byte rows of 32-token pages: 64-byte; 8-token pages:
// none). False, and the caller runs the mma.sync row split, when there is no
// encoder, the rows do not fit the copy's int coordinates, or encoding fails.
template <typename T, int D>
bool EncodeValueTensorMap(const PagedAttentionParams& p, CUtensorMap* map) {
  const TensorMapEncoder encode = DriverTensorMapEncoder();
  const int64_t rows = static_cast<int64_t>(p.num_blocks) * p.num_kv_heads * D;
  if (encode == nullptr || rows <= 0 || rows > INT_MAX ||
      reinterpret_cast<uintptr_t>(p.value_cache) % 16 != 0)
    return false;
  const int bs = p.block_size;  // 8, 16 or 32 (checked by the handler)
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(bs), static_cast<cuuint64_t>(rows)};
  const cuuint64_t row_stride[1] = {static_cast<cuuint64_t>(bs) * sizeof(T)};  // bytes
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(bs), static_cast<cuuint32_t>(D)};
  const cuuint32_t unit[2] = {1u, 1u};
  const CUtensorMapSwizzle swizzle = bs == 16   ? CU_TENSOR_MAP_SWIZZLE_32B
                                     : bs == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                : CU_TENSOR_MAP_SWIZZLE_NONE;
  const CUtensorMapDataType dtype = std::is_same_v<T, __nv_bfloat16>
                                        ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                        : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, dtype, 2, const_cast<void*>(p.value_cache), dims, row_stride, box, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The row split's 64-row kernel with wgmma (kWgmma), for 16-bit caches of the
// query's dtype T and head sizes D % 16 == 0 (WgmmaRowSplitAvailable), one per
// block size (its products' layouts, and the n-tiles they fill, depend on it).
// Defined only in the sm_90a translation units (instances/wgmma_grouped_*.cu,
// built when JAX_PAGED_HAVE_WGMMA), which instantiate it per head size.
template <typename T, int D>
GroupedInstance WgmmaRowSplitInstance(int block_size);
// Its 128-row CTAs (two warpgroups, deferred P.V; above 64 rows per KV head), in the
// same translation units.
template <typename T, int D>
GroupedInstance WgmmaRowSplit128Instance(int block_size);

// Raises the shared-memory limit and the carveout hint of one kernel
// instantiation, once per device.
inline cudaError_t ConfigureGroupedKernel(const GroupedInstance& g, int device) {
  if (cudaError_t err = EnsureSmemOptin(g.kernel, g.smem_bytes, device, g.smem_configured);
      err != cudaSuccess)
    return err;
  // All data goes through shared memory: prefer the largest carveout so that
  // two CTAs fit per SM (a hint; failure is harmless).
  if (device >= 0 && device < kMaxDevices &&
      !g.carveout_set[device].load(std::memory_order_acquire)) {
    if (cudaFuncSetAttribute(g.kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared) != cudaSuccess)
      (void)cudaGetLastError();
    g.carveout_set[device].store(true, std::memory_order_release);
  }
  return cudaSuccess;
}

// One kernel variant for the call's block size: fp8 caches and the row split
// have one instantiation per block size (their loops are bound by instruction
// issue; constant shared-memory offsets saved ~10% of fp8's instructions, and
// the row split's ldmatrix addresses fold into immediates), the others read it
// at run time.
template <typename T, typename TC, int D, bool kPlain, bool kCap = false, int kRowBlocks = 1,
          bool kWgmma = false, bool kHalfRows = false, int kWarpgroups = 1,
          bool kDeferPv = false, int kFp8Ctas = 0>
GroupedInstance GroupedInstanceForBlockSize(int block_size) {
  using C = GroupedConfig<static_cast<int>(sizeof(T)), static_cast<int>(sizeof(TC)), D>;
  if constexpr (C::kFp8 || kRowBlocks > 1) {
    switch (block_size) {  // 8, 16 or 32 (checked by the handler)
      case 8:
        return GroupedInstanceOf<T, TC, D, kPlain, 8, kCap, kRowBlocks, kWgmma, kHalfRows,
                                 kWarpgroups, kDeferPv, kFp8Ctas>();
      case 16:
        return GroupedInstanceOf<T, TC, D, kPlain, 16, kCap, kRowBlocks, kWgmma, kHalfRows,
                                 kWarpgroups, kDeferPv, kFp8Ctas>();
      default:
        return GroupedInstanceOf<T, TC, D, kPlain, 32, kCap, kRowBlocks, kWgmma, kHalfRows,
                                 kWarpgroups, kDeferPv, kFp8Ctas>();
    }
  } else {
    return GroupedInstanceOf<T, TC, D, kPlain, 0, kCap, kRowBlocks, kWgmma, kHalfRows>();
  }
}

// The plain step's kernel (with the soft cap of kCap). With the tensor cores
// (16-bit queries) it takes its half-rows form (kHalfRows) when the call's CTAs
// have at most 8 query rows: up to 8 query heads per KV head, as in most
// grouped-query models, unless KernelOptions::half_rows is off.
template <typename T, typename TC, int D, bool kCap, int kFp8Ctas = 0>
GroupedInstance PlainInstance(const PagedAttentionParams& p) {
  using C = GroupedConfig<static_cast<int>(sizeof(T)), static_cast<int>(sizeof(TC)), D>;
  if constexpr (C::kMma) {
    if (RowsPerKvHead(p) <= kMaxRows / 2 && GetKernelOptions().half_rows)
      return GroupedInstanceForBlockSize<T, TC, D, true, kCap, 1, false, true, 1, false,
                                         kFp8Ctas>(p.block_size);
  }
  return GroupedInstanceForBlockSize<T, TC, D, true, kCap, 1, false, false, 1, false, kFp8Ctas>(
      p.block_size);
}

#ifdef JAX_PAGED_WGMMA_TU
template <typename T, int D>
GroupedInstance WgmmaRowSplitInstance(int block_size) {
  return GroupedInstanceForBlockSize<T, T, D, false, false, 4, true>(block_size);
}
template <typename T, int D>
GroupedInstance WgmmaRowSplit128Instance(int block_size) {
  return GroupedInstanceForBlockSize<T, T, D, false, false, 4, true, false, 2, true>(block_size);
}
#endif

// The kernel for a call: plain (see the kernel) or general. A plain step with
// a soft cap has its own kernel with 16-bit caches of the query's dtype; fp8
// and f32 caches run the general one (fewer instantiations).
// v_map: the wgmma form's value-cache tensor map, encoded here when that form is chosen.
// kFp8Ctas: WithGroupedLayout's CTAs per SM of the fp8 decode kernels (0: four).
template <typename T, typename TC, int D, int kRowBlocks = 1, int kFp8Ctas = 0>
GroupedInstance SelectGroupedKernelOf(const PagedAttentionParams& p, int device,
                                      CUtensorMap* v_map) {
  using C = GroupedConfig<static_cast<int>(sizeof(T)), static_cast<int>(sizeof(TC)), D>;
#ifdef JAX_PAGED_HAVE_WGMMA
  if constexpr (kRowBlocks == 4 && WgmmaRowSplitAvailable(sizeof(T), sizeof(TC), D)) {
    // (Without a tensor map of the value cache, see EncodeValueTensorMap, the
    // mma.sync row split runs: the same results.)
    if (WgmmaEnabled(device) && EncodeValueTensorMap<T, D>(p, v_map)) {
      if (RowsPerKvHead(p) > kRowBlocks * kMaxRows && Wgmma128Enabled())
        return WgmmaRowSplit128Instance<T, D>(p.block_size);
      return WgmmaRowSplitInstance<T, D>(p.block_size);
    }
  }
#else
  (void)device;
  (void)v_map;
#endif
  // (The row split runs multi-token queries only, never the plain step: kRowBlocks
  // > 1 instantiates the general kernel alone.)
  if constexpr (kRowBlocks == 1) {
    const bool plain_shape = p.q_len == 1 && p.alibi_slopes == nullptr;  // windowed or not
    const bool capped = p.soft_cap > 0.0f;
    if (plain_shape && !capped) return PlainInstance<T, TC, D, false, kFp8Ctas>(p);
    if constexpr (C::kMma && !C::kFp8) {
      if (plain_shape) return PlainInstance<T, TC, D, true>(p);
    }
  }
  return GroupedInstanceForBlockSize<T, TC, D, false, false, kRowBlocks, false, false, 1, false,
                                     kFp8Ctas>(p.block_size);
}

// The kernel for a call: the row split, a CTA of 32 or 64 rows (RowBlocks), for
// multi-token queries with more than 16 query rows per KV head (q_len * group),
// which would otherwise take several 16-row CTAs that each read the KV head's
// pages; else SelectGroupedKernelOf's 16-row kernel. (Only where RowSplitAvailable
// are row-split kernels instantiated: 16-bit queries.) WithGroupedLayout, so that
// the layout GroupedInfo reports is the one that runs.
template <typename T, typename TC, int D>
GroupedInstance SelectGroupedKernel(const PagedAttentionParams& p, int device,
                                    CUtensorMap* v_map) {
  return WithGroupedLayout<static_cast<int>(sizeof(T)), static_cast<int>(sizeof(TC)), D>(
      p.q_len, RowsPerKvHead(p), int64_t{p.num_seqs} * p.num_kv_heads,
      [&](auto row_blocks, auto fp8_ctas) {
        return SelectGroupedKernelOf<T, TC, D, decltype(row_blocks)::value,
                                     decltype(fp8_ctas)::value>(p, device, v_map);
      });
}

#ifdef JAX_PAGED_PROBE_NO_REDUCE
constexpr bool kProbeNoReduce = true;  // timing probe (development, wrong results with a split)
#else
constexpr bool kProbeNoReduce = false;
#endif

template <typename T, typename TC, int HEAD_SIZE>
cudaError_t LaunchGroupedAttention(const PagedAttentionParams& p, int device,
                                   cudaStream_t stream) {
  CUtensorMap v_map{};  // (zeros, unread, unless the wgmma form runs)
  const GroupedInstance g = SelectGroupedKernel<T, TC, HEAD_SIZE>(p, device, &v_map);
  if (cudaError_t err = ConfigureGroupedKernel(g, device); err != cudaSuccess) return err;
  const int rows = RowsPerKvHead(p);
  const int group_chunks = (rows + g.max_rows - 1) / g.max_rows;
  const int rows_per_cta = (rows + group_chunks - 1) / group_chunks;
  const bool direct_out = p.max_num_partitions == 1;
  const bool pdl = UseProgrammaticLaunch(device);
  for (int base = 0; base < p.num_seqs; base += kMaxGridYZ) {
    const int n = std::min(kMaxGridYZ, p.num_seqs - base);
    g.kernel<<<dim3(p.num_kv_heads * group_chunks, n, GroupedGridPartitions(p)), g.threads,
             g.smem_bytes, stream>>>(p, base, group_chunks, rows_per_cta, direct_out, v_map);
    if (!direct_out && !kProbeNoReduce) {
      if (cudaError_t err = LaunchReduce<T>(p, base, n, pdl, stream); err != cudaSuccess)
        return err;
    }
  }
  return cudaGetLastError();
}

}  // namespace grouped
}  // namespace cuda
}  // namespace jax_paged

// The wgmma row-split kernels for one 16-bit dtype and head size (instances/wgmma_grouped_*.cu).
#define JAX_PAGED_INSTANTIATE_GROUPED_WGMMA(T, H)                                   \
  template jax_paged::cuda::grouped::GroupedInstance                               \
  jax_paged::cuda::grouped::WgmmaRowSplitInstance<T, H>(int);                      \
  template jax_paged::cuda::grouped::GroupedInstance                               \
  jax_paged::cuda::grouped::WgmmaRowSplit128Instance<T, H>(int);

// Explicit instantiation for one dtype and head size (instances/grouped_*.cu).
#define JAX_PAGED_INSTANTIATE_GROUPED(T, TC, H)                                        \
  template cudaError_t jax_paged::cuda::grouped::LaunchGroupedAttention<T, TC, H>(     \
      const jax_paged::PagedAttentionParams&, int, cudaStream_t);
