// PagedAttention V1 / V2 decode kernels and the V2 reduce kernel, after the
// classic vLLM v0.6.0 design. Framework-free.
//
// Semantics (the contract shared with the CPU kernels and the Python
// reference), per sequence s, query position qi (of q_len) and query head h:
//   L      = EffectiveSeqLen(seq_lens[s], max_blocks_per_seq, block_size)
//   [start, end) = QueryRowRange(L, q_len, qi, sliding_window): the causal
//            range of the row at position L - q_len + qi, cut to its last
//            sliding_window tokens (decode: [0, L))
//   kvh    = h / (num_heads / num_kv_heads)
//   l_t    = scale * k_scale[kvh] * q.k_t + (alibi ? slope[h] * (t - (end - 1)) : 0)
//   l_t    = soft_cap > 0 ? soft_cap * tanh(l_t / soft_cap) : l_t
//   masked = t outside [start, end), or the token's physical block id is
//            outside [0, num_blocks): excluded from max and sum, K/V never
//            read. Table entries of blocks outside [start / block_size,
//            ceil(end / block_size)) are never read at all.
//   p_t    = exp(l_t - max) / (sum + 1e-6);  out = v_scale[kvh] * sum_t p_t v_t
//   lse    = max + log(sum + 1e-6), -inf when sum == 0 (optional output)
//   Nothing attended -> zeros.
// V2 partition p (tokens [p * ps, (p + 1) * ps) intersected with the row's range):
//   m_p = max l_t (-FLT_MAX if none valid), s_p = sum exp(l_t - m_p),
//   tmp_out_p = v_scale * sum_t exp(l_t - m_p) v_t / (s_p + 1e-6).
//   Partitions that do not overlap the range write m_p = -FLT_MAX, s_p = 0,
//   tmp_out_p = 0 and exit; the reduce never reads them anyway.
// Reduce: M = max_p m_p, w_p = s_p exp(m_p - M), W = sum_p w_p,
//   out = sum_p tmp_out_p w_p / (W + 1e-6), lse = M + log(W + 1e-6), over
//   the partitions that overlap the row's range (zeros / -inf for none).
//
// V1 and V2 are one kernel template with a run-time `v2` flag (V1 = a single
// partition covering the whole table, output written directly): the only
// differences are the token range and where the result goes, and it halves
// the number of instantiations (build time). The reduce kernel is templated
// on the output dtype only (head size at run time).
//
// Template parameters: T, the query / output storage type (or RuntimeFloat:
// chosen at run time from p.query_kind, used with fp8 caches so that they
// need one instantiation per cache type, not per (query, cache) pair: the
// query is read once into shared memory as fp32 and the output written once,
// so the run-time switch costs nothing); TC, the cache storage type (T, or
// __nv_fp8_e4m3 / __nv_fp8_e5m2, whose x = 16).
//
// Multi-token queries fold into the grid: blockIdx.x = head * q_len + qi, so
// each CTA is one (sequence, position, head) row with its own causal range,
// and the q_len rows of a head (and the heads of a KV head) are neighbours in
// the grid: their K/V reads hit L2.
//
// Shared memory (all dynamic, PagedAttentionSmemBytes): fp32 query, 8 floats
// of reduction scratch, fp32 logits: V1 max_blocks_per_seq * block_size
// slots (with a sliding window w, (ceil(w / block_size) + 1) * block_size
// at most), V2 partition_size slots, at least 4 * head_size (reused for the
// cross-warp output reduction).
//
// Thread mapping (128 threads = 4 warps per CTA):
// * QK: THREAD_GROUP_SIZE G = 32 / BLOCK_SIZE lanes per token, so one warp
//   covers one KV block per iteration; warps take logical blocks round-robin.
//   Each lane of a group loads VEC = x / G elements per x-chunk of the key
//   (the group together reads one 16-byte chunk; the warp reads
//   BLOCK_SIZE * 16 contiguous bytes), so head_size / x chunks per lane:
//   integral for every supported head size (head_size % x == 0), no
//   remainder. The partial dot is reduced inside the group by shuffles.
// * PV: V_VEC = min(x, BLOCK_SIZE) consecutive tokens (up to 16 bytes) per
//   load; BLOCK_SIZE / V_VEC lanes per V row, 32 / (BLOCK_SIZE / V_VEC) rows
//   per warp per step; head_size need not be a multiple of that (rows >=
//   head_size are predicated off).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "cuda/dtypes.cuh"
#include "cuda/launch.h"
#include "params.h"

namespace jax_paged {
namespace cuda {

template <typename TC, int HEAD_SIZE, int BLOCK_SIZE>
struct AttnConfig {
  static constexpr int kX = 16 / static_cast<int>(sizeof(TC));  // K-layout x
  static_assert(BLOCK_SIZE <= 32 && 32 % BLOCK_SIZE == 0, "block size must divide 32");
  static_assert(HEAD_SIZE % kX == 0, "head size must be a multiple of x");
  // QK stage.
  static constexpr int kGroup = 32 / BLOCK_SIZE;  // THREAD_GROUP_SIZE
  static constexpr int kVec = kX / kGroup;        // elements per lane per chunk
  static_assert(kVec >= 1 && kVec * kGroup == kX, "group must split a 16-byte chunk");
  static constexpr int kChunks = HEAD_SIZE / kX;  // x-chunks of one key
  // PV stage.
  static constexpr int kVVec = kX < BLOCK_SIZE ? kX : BLOCK_SIZE;  // min(16 / sizeof(TC), B)
  static constexpr int kVecsPerRow = BLOCK_SIZE / kVVec;
  static constexpr int kRowsPerIter = 32 / kVecsPerRow;
  static constexpr int kRowsPerThread = (HEAD_SIZE + kRowsPerIter - 1) / kRowsPerIter;
};

// ---- query / output of a static or run-time dtype ----------------------------

// Stages query row `row` into shared memory as fp32, one 16-byte chunk per
// thread.
template <typename T, int HEAD_SIZE>
__device__ __forceinline__ void StageQueryAs(const void* query, int64_t row, float* q_smem,
                                             int tid) {
  constexpr int QX = 16 / static_cast<int>(sizeof(T));
  static_assert(HEAD_SIZE % QX == 0 && HEAD_SIZE / QX <= kAttnThreads, "query chunks");
  if (tid < HEAD_SIZE / QX) {
    float q[QX];
    LoadToFloat<T, QX>(static_cast<const T*>(query) + row * HEAD_SIZE + tid * QX, q);
    StoreFloats<QX>(q_smem + tid * QX, q);
  }
}

template <typename T, int HEAD_SIZE>
__device__ __forceinline__ void StageQuery(const PagedAttentionParams& p, int64_t row,
                                           float* q_smem, int tid) {
  if constexpr (std::is_same_v<T, RuntimeFloat>) {
    switch (p.query_kind) {
      case ScalarKind::kF32: StageQueryAs<float, HEAD_SIZE>(p.query, row, q_smem, tid); break;
      case ScalarKind::kF16: StageQueryAs<__half, HEAD_SIZE>(p.query, row, q_smem, tid); break;
      case ScalarKind::kBF16:
        StageQueryAs<__nv_bfloat16, HEAD_SIZE>(p.query, row, q_smem, tid);
        break;
    }
  } else {
    StageQueryAs<T, HEAD_SIZE>(p.query, row, q_smem, tid);
  }
}

// out[idx] = v, converted to the output dtype.
template <typename T>
__device__ __forceinline__ void StoreOut(const PagedAttentionParams& p, int64_t idx, float v) {
  if constexpr (std::is_same_v<T, RuntimeFloat>) {
    switch (p.query_kind) {
      case ScalarKind::kF32: static_cast<float*>(p.out)[idx] = v; break;
      case ScalarKind::kF16: static_cast<__half*>(p.out)[idx] = FromFloat<__half>(v); break;
      case ScalarKind::kBF16:
        static_cast<__nv_bfloat16*>(p.out)[idx] = FromFloat<__nv_bfloat16>(v);
        break;
    }
  } else {
    static_cast<T*>(p.out)[idx] = FromFloat<T>(v);
  }
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere): the V2 reduce
// is launched so that it may start before the attention kernel has finished.
__device__ __forceinline__ void GridDependencyWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the dependent grid (the reduce) launch: called by each attention CTA
// once it no longer needs the SM to itself (no effect without PDL).
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// log-sum-exp consistent with out = acc / (sum + 1e-6); -inf when empty.
__device__ __forceinline__ float LogSumExp(float max_logit, float sum) {
  return sum > 0.0f ? max_logit + logf(sum + 1e-6f) : -INFINITY;
}

// One CTA per (query head, query position, sequence[, partition]):
// blockIdx.x = head * q_len + qi, blockIdx.y = sequence - seq_base.
//   v2 == false: one partition covering the row's whole range, writes p.out
//                (and p.lse).
//   v2 == true:  partition blockIdx.z of `part_tokens` tokens, writes
//                p.max_logits / p.exp_sums / p.tmp_out.
template <typename T, typename TC, int HEAD_SIZE, int BLOCK_SIZE>
__global__ void __launch_bounds__(kAttnThreads)
    PagedAttentionKernel(const PagedAttentionParams p, const int seq_base, const int part_tokens,
                         const bool v2) {
  using Cfg = AttnConfig<TC, HEAD_SIZE, BLOCK_SIZE>;
  constexpr int X = Cfg::kX;
  constexpr int G = Cfg::kGroup;
  constexpr int VEC = Cfg::kVec;

  const int q_len = p.q_len;
  const int head = static_cast<int>(blockIdx.x) / q_len;
  const int qi = static_cast<int>(blockIdx.x) % q_len;
  const int seq = seq_base + static_cast<int>(blockIdx.y);
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  const int L = EffectiveSeqLen(p.seq_lens[seq], p.max_blocks_per_seq, BLOCK_SIZE);
  const TokenRange range = QueryRowRange(L, q_len, qi, p.sliding_window);
  // (seq, position, head) row of query / out / lse / workspace.
  const int64_t row = (static_cast<int64_t>(seq) * q_len + qi) * p.num_heads + head;
  const int64_t part_row = row * p.max_num_partitions + part;          // V2 workspace row

  // Blocks read: those the row's range touches (blocks wholly outside a
  // sliding window are skipped), within this partition for V2.
  int start_blk = range.start / BLOCK_SIZE;
  int end_blk = range.end / BLOCK_SIZE + (range.end % BLOCK_SIZE != 0);  // ceil, no overflow
  if (v2) {
    const int blocks_per_part = part_tokens / BLOCK_SIZE;
    start_blk = max(start_blk, part * blocks_per_part);
    end_blk = min(end_blk, part * blocks_per_part + blocks_per_part);
    if (start_blk >= end_blk) {
      // Nothing to attend to in this partition: leave a well-defined (empty)
      // partial result and exit. The reduce does not read it.
      if (tid == 0) {
        p.max_logits[part_row] = -FLT_MAX;
        p.exp_sums[part_row] = 0.0f;
      }
      for (int d = tid; d < HEAD_SIZE; d += kAttnThreads)
        p.tmp_out[part_row * HEAD_SIZE + d] = 0.0f;
      return;
    }
  }
  const int start_tok = start_blk * BLOCK_SIZE;
  const int num_slots = max(end_blk - start_blk, 0) * BLOCK_SIZE;  // logits used

  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[head] : 0.0f;
  const float qk_scale =
      p.scale * (p.k_scale != nullptr ? p.k_scale[kv_head * p.k_scale_stride] : 1.0f);
  const float v_scale = p.v_scale != nullptr ? p.v_scale[kv_head * p.v_scale_stride] : 1.0f;
  const float soft_cap = p.soft_cap;

  // Shared memory (all dynamic, see PagedAttentionSmemBytes).
  extern __shared__ float4 smem_f4[];
  float* q_smem = reinterpret_cast<float*>(smem_f4);  // [HEAD_SIZE]
  float* red_smem = q_smem + HEAD_SIZE;               // [2 * kAttnWarps]
  float* logits = red_smem + 2 * kAttnWarps;          // [max(slots, warps * HEAD_SIZE)]

  AllowDependentLaunch();  // V2's reduce may be scheduled; it waits for this grid
  // Stage the query once, in fp32.
  StageQuery<T, HEAD_SIZE>(p, row, q_smem, tid);
  __syncthreads();

  const int32_t* block_table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const int64_t kv_block_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_SIZE * BLOCK_SIZE;
  const int64_t kv_head_offset = static_cast<int64_t>(kv_head) * HEAD_SIZE * BLOCK_SIZE;

  // ---- QK: logits of this partition, and their max ------------------------
  const int tok_in_blk = lane / G;  // this lane's token within the block
  const int group_lane = lane % G;  // this lane's slice of each x-chunk
  float qk_max = -FLT_MAX;
  for (int blk = start_blk + warp; blk < end_blk; blk += kAttnWarps) {
    const int64_t phys = static_cast<int64_t>(block_table[blk]);
    const bool valid = phys >= 0 && phys < p.num_blocks;  // warp-uniform
    const int t = blk * BLOCK_SIZE + tok_in_blk;
    float qk = -INFINITY;  // masked tokens: exp(-inf - max) == 0 exactly
    if (valid) {
      const TC* k_ptr = static_cast<const TC*>(p.key_cache) + phys * kv_block_stride +
                        kv_head_offset + tok_in_blk * X + group_lane * VEC;
      const float* q_ptr = q_smem + group_lane * VEC;
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < Cfg::kChunks; ++j) {
        float k[VEC], q[VEC];
        LoadToFloat<TC, VEC>(k_ptr + j * BLOCK_SIZE * X, k);
        LoadFloats<VEC>(q_ptr + j * X, q);
        dot = DotAcc<VEC>(q, k, dot);
      }
      dot = WarpSum<G>(dot);  // reduce inside the thread group
      if (t >= range.start && t < range.end) {
        qk = qk_scale * dot + slope * static_cast<float>(t - (range.end - 1));
        if (soft_cap > 0.0f) qk = soft_cap * tanhf(qk / soft_cap);
        qk_max = fmaxf(qk_max, qk);
      }
    }
    if (group_lane == 0) logits[t - start_tok] = qk;
  }

  // Block-wide max: warp shuffles, then across warps.
  qk_max = WarpMax<32>(qk_max);
  if (lane == 0) red_smem[warp] = qk_max;
  __syncthreads();
  qk_max = red_smem[0];
#pragma unroll
  for (int w = 1; w < kAttnWarps; ++w) qk_max = fmaxf(qk_max, red_smem[w]);

  // exp(l - max) over every slot of the partition's blocks (masked slots hold
  // -inf and become exactly 0, so the PV stage may read whole blocks), and
  // the block-wide sum.
  float exp_sum = 0.0f;
  for (int i = tid; i < num_slots; i += kAttnThreads) {
    const float e = expf(logits[i] - qk_max);
    logits[i] = e;
    exp_sum += e;
  }
  exp_sum = WarpSum<32>(exp_sum);
  if (lane == 0) red_smem[kAttnWarps + warp] = exp_sum;
  __syncthreads();  // also publishes the exp'd logits to every warp
  exp_sum = red_smem[kAttnWarps];
#pragma unroll
  for (int w = 1; w < kAttnWarps; ++w) exp_sum += red_smem[kAttnWarps + w];
  const float out_scale = v_scale / (exp_sum + 1e-6f);

  if (tid == 0) {
    if (v2) {
      p.max_logits[part_row] = qk_max;
      p.exp_sums[part_row] = exp_sum;
    } else if (p.lse != nullptr) {
      p.lse[row] = LogSumExp(qk_max, exp_sum);
    }
  }

  // ---- PV: out = sum_t e_t v_t (normalised at the end) --------------------
  constexpr int V_VEC = Cfg::kVVec;
  constexpr int NVPR = Cfg::kVecsPerRow;
  constexpr int RPI = Cfg::kRowsPerIter;
  constexpr int RPT = Cfg::kRowsPerThread;
  float accs[RPT];
#pragma unroll
  for (int i = 0; i < RPT; ++i) accs[i] = 0.0f;

  const int vec_off = (lane % NVPR) * V_VEC;  // first token of this lane's vector
  const int row0 = lane / NVPR;
  for (int blk = start_blk + warp; blk < end_blk; blk += kAttnWarps) {
    const int64_t phys = static_cast<int64_t>(block_table[blk]);
    if (phys < 0 || phys >= p.num_blocks) continue;  // masked block: V never read
    const int t0 = blk * BLOCK_SIZE + vec_off;
    float probs[V_VEC];
    LoadFloats<V_VEC>(logits + (blk - start_blk) * BLOCK_SIZE + vec_off, probs);
    // A block cut by the range (the tail of the last block, the head of a
    // sliding window's first block).
    const bool edge = blk * BLOCK_SIZE < range.start || (blk + 1) * BLOCK_SIZE > range.end;
    const TC* v_ptr = static_cast<const TC*>(p.value_cache) + phys * kv_block_stride +
                      kv_head_offset + vec_off;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = row0 + i * RPI;
      if (RPT * RPI <= HEAD_SIZE || r < HEAD_SIZE) {
        float v[V_VEC];
        LoadToFloat<TC, V_VEC>(v_ptr + r * BLOCK_SIZE, v);
        if (edge) {
          // Slots outside the range may hold stale data or NaN, and
          // 0 * NaN = NaN: zero the values, not just their probabilities.
#pragma unroll
          for (int j = 0; j < V_VEC; ++j)
            v[j] = (t0 + j >= range.start && t0 + j < range.end) ? v[j] : 0.0f;
        }
        accs[i] = DotAcc<V_VEC>(probs, v, accs[i]);
      }
    }
  }

  // Reduce over the lanes sharing a row, then across warps through shared
  // memory reused from the logits (barrier first: other warps may still be
  // reading probabilities).
#pragma unroll
  for (int i = 0; i < RPT; ++i) accs[i] = WarpSum<NVPR>(accs[i]);
  __syncthreads();
  float* out_smem = logits;  // [kAttnWarps][HEAD_SIZE]
  if (lane % NVPR == 0) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = row0 + i * RPI;
      if (RPT * RPI <= HEAD_SIZE || r < HEAD_SIZE) out_smem[warp * HEAD_SIZE + r] = accs[i];
    }
  }
  __syncthreads();
  for (int d = tid; d < HEAD_SIZE; d += kAttnThreads) {
    float o = out_smem[d];
#pragma unroll
    for (int w = 1; w < kAttnWarps; ++w) o += out_smem[w * HEAD_SIZE + d];
    o *= out_scale;
    if (v2) {
      p.tmp_out[part_row * HEAD_SIZE + d] = o;
    } else {
      StoreOut<T>(p, row * HEAD_SIZE + d, o);
    }
  }
}

// V2 reduce: one CTA per (query head, query position, sequence), grid
// (num_heads * q_len, sequences), head size at run time (at most
// kRows * kAttnThreads), thread t owning output elements t, t + kAttnThreads,
// ... Reads only the partitions that overlap the row's range. Each thread
// merges them on its own, kChunk partitions at a time with a running maximum
// (acc and sum rescaled when it grows): all loads of a chunk (every
// partition's max and sum, the thread's tmp_out elements) are issued together,
// with no shared memory or barrier (a reduce that first finds the global max
// and then merges through shared memory takes about five dependent trips).
// T: the output dtype (or RuntimeFloat).
//
// Launched as a programmatic dependent of the attention kernel when the
// device supports it (LaunchReduce): the CTAs may start before the attention
// kernel has finished, so nothing written by it is read before
// GridDependencyWait().
constexpr int kMaxReduceRows = 2;  // head_size <= 2 * kAttnThreads

// kChunk: partitions per round of loads, (2 + kRows) * kChunk values in
// registers (LaunchReduce picks a small chunk, and so more resident CTAs, when
// every row has few partitions).
template <typename T, int kRows, int kChunk>
__global__ void __launch_bounds__(kAttnThreads)
    PagedAttentionReduceKernel(const PagedAttentionParams p, const int seq_base) {
  const int q_len = p.q_len;
  const int head = static_cast<int>(blockIdx.x) / q_len;
  const int qi = static_cast<int>(blockIdx.x) % q_len;
  const int seq = seq_base + static_cast<int>(blockIdx.y);
  const int tid = threadIdx.x;
  const int D = p.head_size;
  const int PS = p.partition_size;

  // Inputs of the launch (not written by the attention kernel) first.
  const int L = EffectiveSeqLen(p.seq_lens[seq], p.max_blocks_per_seq, p.block_size);
  const TokenRange range = QueryRowRange(L, q_len, qi, p.sliding_window);
  const int first = range.start / PS;
  const int last = range.end > range.start ? range.end / PS + (range.end % PS != 0) : first;
  const int num_parts = last - first;
  const int64_t row = (static_cast<int64_t>(seq) * q_len + qi) * p.num_heads + head;
  const float* max_logits = p.max_logits + row * p.max_num_partitions + first;
  const float* exp_sums = p.exp_sums + row * p.max_num_partitions + first;
  const float* tmp_out = p.tmp_out + (row * p.max_num_partitions + first) * D;
  GridDependencyWait();

  // out = sum_p w_p tmp_out_p / sum_p w_p, w_p = s_p exp(m_p - M), M the
  // maximum of the m_p: accumulated against the running maximum m.
  float m = -FLT_MAX;
  float w_sum = 0.0f;
  float acc[kRows] = {};
  for (int c = 0; c < num_parts; c += kChunk) {
    float part_max[kChunk], part_sum[kChunk], part_out[kRows][kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const bool in = c + j < num_parts;
      part_max[j] = in ? max_logits[c + j] : -FLT_MAX;
      part_sum[j] = in ? exp_sums[c + j] : 0.0f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int d = tid + r * kAttnThreads;
        part_out[r][j] = in && d < D ? tmp_out[static_cast<int64_t>(c + j) * D + d] : 0.0f;
      }
    }
    float m_new = m;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) m_new = fmaxf(m_new, part_max[j]);
    const float rescale = expf(m - m_new);  // 1 while both are -FLT_MAX
    w_sum *= rescale;
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] *= rescale;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float w = part_sum[j] * expf(part_max[j] - m_new);  // 0 for padding and empty parts
      w_sum += w;
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] = fmaf(part_out[r][j], w, acc[r]);
    }
    m = m_new;
  }
  const float inv = 1.0f / (w_sum + 1e-6f);
  if (tid == 0 && p.lse != nullptr) p.lse[row] = LogSumExp(m, w_sum);

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int d = tid + r * kAttnThreads;
    if (d < D) StoreOut<T>(p, row * D + d, acc[r] * inv);
  }
}

// Launches the reduce over sequences [seq_base, seq_base + n) after the
// attention kernel just launched on `stream`: as a programmatic dependent
// launch (it may start while that kernel drains; see GridDependencyWait) when
// `pdl` (UseProgrammaticLaunch).
template <typename T>
cudaError_t LaunchReduce(const PagedAttentionParams& p, int seq_base, int n, bool pdl,
                         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_heads) * static_cast<unsigned>(p.q_len), n);
  // One output element per thread (head size <= kAttnThreads) leaves the
  // registers for 40 partitions per round of loads (255 registers), two for 16
  // (128 registers); 8 partitions or fewer per row need fewer registers.
  const bool one_row = p.head_size <= kAttnThreads;
  const bool few_parts = p.max_num_partitions <= 8;
  auto kernel = one_row ? (few_parts ? PagedAttentionReduceKernel<T, 1, 8>
                                     : PagedAttentionReduceKernel<T, 1, 40>)
                        : (few_parts ? PagedAttentionReduceKernel<T, kMaxReduceRows, 8>
                                     : PagedAttentionReduceKernel<T, kMaxReduceRows, 16>);
  return LaunchKernel(kernel, grid, dim3(kAttnThreads), 0, stream, pdl, p, seq_base);
}

// Raises the kernel's dynamic shared-memory limit to the device's opt-in
// maximum, once per (kernel, device). Needed only above the 48 KiB default.
template <typename Kernel>
cudaError_t EnsureSmemOptin(Kernel kernel, size_t smem_bytes, int device,
                            std::atomic<bool>* done /* [kMaxDevices] */) {
  if (smem_bytes <= 48 * 1024) return cudaSuccess;
  const bool cacheable = device >= 0 && device < kMaxDevices;
  if (cacheable && done[device].load(std::memory_order_acquire)) return cudaSuccess;
  const int optin = MaxSharedMemoryOptin(device);
  const int limit = optin > 0 ? optin : static_cast<int>(smem_bytes);
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
  if (err != cudaSuccess) return err;
  if (cacheable && optin > 0) done[device].store(true, std::memory_order_release);
  return cudaSuccess;
}

template <typename T, typename TC, int HEAD_SIZE, int BLOCK_SIZE>
cudaError_t LaunchPagedAttention(const PagedAttentionParams& p, bool v2, size_t smem_bytes,
                                 int device, cudaStream_t stream) {
  static std::atomic<bool> smem_configured[kMaxDevices];
  auto kernel = &PagedAttentionKernel<T, TC, HEAD_SIZE, BLOCK_SIZE>;
  if (cudaError_t err = EnsureSmemOptin(kernel, smem_bytes, device, smem_configured);
      err != cudaSuccess)
    return err;
  const int part_tokens = v2 ? p.partition_size : p.max_blocks_per_seq * BLOCK_SIZE;
  const int parts = v2 ? p.max_num_partitions : 1;
  for (int base = 0; base < p.num_seqs; base += kMaxGridYZ) {
    const int n = std::min(kMaxGridYZ, p.num_seqs - base);
    const unsigned rows = static_cast<unsigned>(p.num_heads) * static_cast<unsigned>(p.q_len);
    kernel<<<dim3(rows, n, parts), kAttnThreads, smem_bytes, stream>>>(p, base, part_tokens, v2);
    if (v2) {
      if (cudaError_t err = LaunchReduce<T>(p, base, n, UseProgrammaticLaunch(device), stream);
          err != cudaSuccess)
        return err;
    }
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace jax_paged

// Explicit instantiation of the launchers of one dtype for a list of head
// sizes (used by the instances/attn_*.cu translation units).
#define JAX_PAGED_INSTANTIATE_ATTN_HB(T, TC, H, B)                                      \
  template cudaError_t jax_paged::cuda::LaunchPagedAttention<T, TC, H, B>(              \
      const jax_paged::PagedAttentionParams&, bool, size_t, int, cudaStream_t);
// Caches of the query's dtype T.
#define JAX_PAGED_INSTANTIATE_ATTN_H(T, H) \
  JAX_PAGED_BLOCK_SIZES(JAX_PAGED_INSTANTIATE_ATTN_HB, T, T, H)
// fp8 caches of type TC, query dtype chosen at run time.
#define JAX_PAGED_INSTANTIATE_ATTN_FP8_H(TC, H) \
  JAX_PAGED_BLOCK_SIZES(JAX_PAGED_INSTANTIATE_ATTN_HB, jax_paged::cuda::RuntimeFloat, TC, H)
// Usage: JAX_PAGED_HEAD_SIZES_A(JAX_PAGED_INSTANTIATE_ATTN_H, __half)
//        JAX_PAGED_FP8_HEAD_SIZES_A(JAX_PAGED_INSTANTIATE_ATTN_FP8_H, __nv_fp8_e4m3)
