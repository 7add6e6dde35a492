// The attention variant of the portable grouped kernel as a small policy: which
// tokens a query row attends (its causal range, cut by a sliding window) and the
// logit transform (scale, ALiBi, soft cap), applied to the mma accumulators. The
// semantics are the contract of params.h / jax_paged/reference.py:
//   logit_t = scale * k_scale * q.k_t + slope * (t - (end - 1)),
//   then cap * tanh(logit_t / cap) when the soft cap is on;
// tokens outside [start, end) of the row's QueryRowRange are masked.
// Framework-free.
#pragma once

#include <cuda_runtime.h>

#include "cuda/sm80/ptx.cuh"
#include "params.h"

namespace jax_paged {
namespace cuda {
namespace sm80 {

// The CTA's share of the work: its sequence, KV head, query rows and the token
// range of its partition. Rows are rows [row0, row0 + rows) of the KV head's
// q_len * group rows, row g = qi * group + h (query position qi, head h of the
// group), so that a decode step's rows are the group's heads.
struct CtaWork {
  int seq, kv_head, group, row0, rows;
  int L;            // effective sequence length
  int part;         // partition of the workspace
  int tok_lo, tok_hi;  // tokens of the partition that some row attends
  int first_start;  // the first row's range start (the grid's window offset)

  // Workspace / out / lse row of local row r: ((seq, qi), head).
  __device__ __forceinline__ int64_t HeadRow(const PagedAttentionParams& p, int r) const {
    const int g = row0 + r;
    const int qi = g / group;
    return (static_cast<int64_t>(seq) * p.q_len + qi) * p.num_heads + kv_head * group +
           (g - qi * group);
  }
};

// blockIdx.x = kv_head * group_chunks + chunk, blockIdx.y = seq - seq_base,
// blockIdx.z = the partition, counted from the partition of the first row's
// first token when the grid holds fewer partitions than the workspace (a
// sliding window; see PortableGridPartitions).
__device__ __forceinline__ CtaWork MakeCtaWork(const PagedAttentionParams& p, int seq_base,
                                               int group_chunks, int rows_per_cta, int block_size) {
  CtaWork w;
  w.kv_head = static_cast<int>(blockIdx.x) / group_chunks;
  const int chunk = static_cast<int>(blockIdx.x) - w.kv_head * group_chunks;
  w.seq = seq_base + static_cast<int>(blockIdx.y);
  w.group = p.num_heads / p.num_kv_heads;
  w.row0 = chunk * rows_per_cta;
  w.rows = min(rows_per_cta, p.q_len * w.group - w.row0);
  w.L = EffectiveSeqLen(p.seq_lens[w.seq], p.max_blocks_per_seq, block_size);
  // Row ranges grow with the row (start and end both nondecreasing in qi), and
  // consecutive rows' ranges touch: their union is [first.start, last.end).
  const TokenRange first = QueryRowRange(w.L, p.q_len, w.row0 / w.group, p.sliding_window);
  const TokenRange last =
      QueryRowRange(w.L, p.q_len, (w.row0 + max(w.rows, 1) - 1) / w.group, p.sliding_window);
  w.first_start = first.start;
  const int P = p.max_num_partitions;
  w.part = static_cast<int>(blockIdx.z) +
           (static_cast<int>(gridDim.z) < P ? first.start / p.partition_size : 0);
  const int64_t part_lo = static_cast<int64_t>(w.part) * p.partition_size;
  w.tok_lo = static_cast<int>(max(part_lo, static_cast<int64_t>(first.start)));
  w.tok_hi = static_cast<int>(min(part_lo + p.partition_size, static_cast<int64_t>(last.end)));
  return w;
}

// The per-lane variant: the lane's two fragment rows (gid and gid + 8 of the
// CTA's 16), their token ranges and ALiBi slopes, and the logit transform.
struct AttentionVariant {
  float scale_log2;  // logit per unit of the product, in log2 units (no ALiBi, no cap)
  float scale_nat;   // the same in natural units
  float cap;         // soft cap (> 0: on)
  bool alibi;
  bool natural;      // ALiBi or the soft cap: transform in natural units first
  int start[2], end[2];
  float slope[2];

  // `product_scale`: scale * k_scale / q_scale (the query's staging scale).
  __device__ __forceinline__ void Init(const PagedAttentionParams& p, const CtaWork& w,
                                       float product_scale, int gid) {
    scale_nat = product_scale;
    scale_log2 = product_scale * kLog2e;
    cap = p.soft_cap;
    alibi = p.alibi_slopes != nullptr;
    natural = alibi || cap > 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int lr = gid + 8 * r;
      start[r] = 0;
      end[r] = 0;  // padding rows attend nothing
      slope[r] = 0.0f;
      if (lr < w.rows) {
        const int g = w.row0 + lr;
        const int qi = g / w.group;
        const TokenRange range = QueryRowRange(w.L, p.q_len, qi, p.sliding_window);
        start[r] = range.start;
        end[r] = range.end;
        if (alibi) slope[r] = p.alibi_slopes[w.kv_head * w.group + (g - qi * w.group)];
      }
    }
  }

  __device__ __forceinline__ bool Attends(int t, int r) const { return t >= start[r] && t < end[r]; }

  // The logit of accumulator `acc` for token t of fragment row r, in log2 units.
  __device__ __forceinline__ float Logit(float acc, int t, int r) const {
    if (!natural) return acc * scale_log2;
    float l = acc * scale_nat;
    if (alibi) l = fmaf(slope[r], static_cast<float>(t - (end[r] - 1)), l);
    if (cap > 0.0f) l = cap * tanhf(l / cap);
    return l * kLog2e;
  }
};

}  // namespace sm80
}  // namespace cuda
}  // namespace jax_paged
