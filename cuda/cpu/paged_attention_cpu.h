// CPU PagedAttention (V1 and V2) and cache kernels, with the same semantics
// as the CUDA kernels and jax_paged/reference.py:
//   L = EffectiveSeqLen(seq_len); kv head = h / (num_heads / num_kv_heads)
//   query row qi (of q_len) attends t in [start, end) = QueryRowRange(...)
//   logit_t = scale * k_scale * q.k_t + slope[h] * (t - (end - 1))
//   soft cap: logit_t = c * tanh(logit_t / c)
//   tokens whose physical block id is outside [0, num_blocks) are masked
//   p_t = exp(logit_t - max) / (sum + 1e-6); out = v_scale * sum_t p_t v_t
//   lse = max + log(sum + 1e-6) (-inf when nothing is attended)
// One work item is a (sequence, KV head[, partition]): the group's query
// heads and the q_len query positions share every K/V read. Accumulation is
// fp32 for all dtypes; fp8 caches are decoded through a 256-entry table.
#pragma once

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../kernels/params.h"
#include "cpu_scalar.h"
#include "parallel.h"

namespace jax_paged {
namespace cpu {

// One work item attends R "rows" (query vectors) that share a KV head: the
// G query heads of the group times the q_len query positions. Row r attends
// tokens [lo, hi) (its causal / sliding-window range, clipped to the V2
// partition) with ALiBi position `pos` (its own position, end - 1).
struct RowSpan {
  int lo, hi, pos;
};

// Attention of one work item over its rows. Outputs, per row r: m[r] the max
// logit (-FLT_MAX if no token is valid), sum[r] the sum of exp(logit - m),
// acc[r*D + d] the unnormalised sum of exp(logit - m) * v (v not yet
// multiplied by v_scale). TC is the cache's storage type (the query's, or
// fp8); `qk_scale` = scale * k_scale of this KV head.
template <typename TC>
void AttendRows(const PagedAttentionParams& p, int s, int kvh, const RowSpan* rows, int R,
                float qk_scale, const float* slopes /* [R] or nullptr */,
                const float* q /* [R, D], converted */, std::vector<float>& logits, float* acc,
                float* m, float* sum) {
  const int D = p.head_size, B = p.block_size;
  constexpr int x = 16 / static_cast<int>(sizeof(TC));
  std::fill(acc, acc + static_cast<size_t>(R) * D, 0.0f);
  int t0 = INT32_MAX, t1 = 0;  // union of the rows' ranges
  for (int r = 0; r < R; ++r) {
    m[r] = -FLT_MAX;
    sum[r] = 0.0f;
    if (rows[r].hi > rows[r].lo) {
      t0 = std::min(t0, rows[r].lo);
      t1 = std::max(t1, rows[r].hi);
    }
  }
  if (t1 <= t0) return;
  const int n = t1 - t0;
  logits.assign(static_cast<size_t>(R) * n, -INFINITY);

  const TC* kc = static_cast<const TC*>(p.key_cache);
  const TC* vc = static_cast<const TC*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(s) * p.max_blocks_per_seq;
  const int64_t block_stride = static_cast<int64_t>(p.num_kv_heads) * D * B;
  // One block of K (as stored: [D/x][B][x]) and of V (transposed to [B][D])
  // in fp32, converted once and shared by the item's rows; the inner loops
  // then run over contiguous floats and vectorise. Only the union's tokens
  // of a block are converted: blocks wholly outside it are never read.
  std::vector<float> kf(static_cast<size_t>(D) * B), vt(static_cast<size_t>(D) * B);
  std::vector<float> partial(static_cast<size_t>(B) * x);
  const bool cap = p.soft_cap > 0.0f;
  const float inv_cap = cap ? 1.0f / p.soft_cap : 0.0f;

  // Pass 1: logits and running max.
  for (int j = t0 / B; j <= (t1 - 1) / B; ++j) {
    const int64_t block = table[j];
    if (block < 0 || block >= p.num_blocks) continue;  // masked: stays -inf
    const int off0 = std::max(t0, j * B) - j * B;
    const int off1 = std::min(t1, (j + 1) * B) - j * B;
    const TC* kb = kc + block * block_stride + static_cast<int64_t>(kvh) * D * B;
    for (int c = 0; c < D / x; ++c)
      for (int e = off0 * x; e < off1 * x; ++e)
        kf[static_cast<size_t>(c) * B * x + e] = ToFloat(kb[static_cast<int64_t>(c) * B * x + e]);
    for (int r = 0; r < R; ++r) {
      const int a = std::max(rows[r].lo, j * B + off0) - j * B;
      const int b = std::min(rows[r].hi, j * B + off1) - j * B;
      if (a >= b) continue;
      std::fill(partial.begin(), partial.end(), 0.0f);
      for (int c = 0; c < D / x; ++c) {
        const float* qc = q + static_cast<size_t>(r) * D + c * x;
        const float* kcf = kf.data() + static_cast<size_t>(c) * B * x;
        for (int off = a; off < b; ++off)
          for (int i = 0; i < x; ++i) partial[off * x + i] += qc[i] * kcf[off * x + i];
      }
      for (int off = a; off < b; ++off) {
        float dot = 0.0f;
        for (int i = 0; i < x; ++i) dot += partial[off * x + i];
        const int t = j * B + off;
        float logit = qk_scale * dot;
        if (slopes) logit += slopes[r] * static_cast<float>(t - rows[r].pos);
        if (cap) logit = p.soft_cap * std::tanh(logit * inv_cap);
        logits[static_cast<size_t>(r) * n + (t - t0)] = logit;
        m[r] = std::max(m[r], logit);
      }
    }
  }
  // Pass 2: exp and sum (masked tokens are -inf and give exactly 0).
  for (int r = 0; r < R; ++r) {
    float* lg = logits.data() + static_cast<size_t>(r) * n;
    for (int i = 0; i < n; ++i) {
      lg[i] = std::exp(lg[i] - m[r]);
      sum[r] += lg[i];
    }
  }
  // Pass 3: P.V over each row's own tokens only (the stale tail of the last
  // block and tokens outside a window are never read, so NaN there cannot
  // leak in).
  for (int j = t0 / B; j <= (t1 - 1) / B; ++j) {
    const int64_t block = table[j];
    if (block < 0 || block >= p.num_blocks) continue;
    const int off0 = std::max(t0, j * B) - j * B;
    const int off1 = std::min(t1, (j + 1) * B) - j * B;
    const TC* vb = vc + block * block_stride + static_cast<int64_t>(kvh) * D * B;
    for (int d = 0; d < D; ++d)
      for (int off = off0; off < off1; ++off)
        vt[static_cast<size_t>(off) * D + d] = ToFloat(vb[static_cast<int64_t>(d) * B + off]);
    for (int r = 0; r < R; ++r) {
      const int a = std::max(rows[r].lo, j * B + off0) - j * B;
      const int b = std::min(rows[r].hi, j * B + off1) - j * B;
      const float* pr = logits.data() + static_cast<size_t>(r) * n + (j * B - t0);
      float* ar = acc + static_cast<size_t>(r) * D;
      for (int off = a; off < b; ++off) {
        const float pv = pr[off];
        const float* row = vt.data() + static_cast<size_t>(off) * D;
        for (int d = 0; d < D; ++d) ar[d] += pv * row[d];
      }
    }
  }
}

// Rows of work item (s, kvh): r = qi * G + g is query head kvh * G + g at
// query position qi; its index in query / out / lse is
// (s * q_len + qi) * num_heads + kvh * G + g.
inline int64_t RowIndex(const PagedAttentionParams& p, int s, int kvh, int r) {
  const int G = p.num_heads / p.num_kv_heads;
  return (static_cast<int64_t>(s) * p.q_len + r / G) * p.num_heads + kvh * G + r % G;
}

template <typename T>
void LoadQueryRows(const PagedAttentionParams& p, int s, int kvh, float* q) {
  const int R = p.q_len * (p.num_heads / p.num_kv_heads), D = p.head_size;
  const T* query = static_cast<const T*>(p.query);
  for (int r = 0; r < R; ++r) {
    const T* src = query + RowIndex(p, s, kvh, r) * D;
    for (int d = 0; d < D; ++d) q[static_cast<size_t>(r) * D + d] = ToFloat(src[d]);
  }
}

// Per row: the full token range of its query position (no partition clip).
inline void RowSpans(const PagedAttentionParams& p, int L, std::vector<RowSpan>& spans) {
  const int G = p.num_heads / p.num_kv_heads;
  spans.resize(static_cast<size_t>(p.q_len) * G);
  for (int qi = 0; qi < p.q_len; ++qi) {
    const TokenRange tr = QueryRowRange(L, p.q_len, qi, p.sliding_window);
    for (int g = 0; g < G; ++g) spans[static_cast<size_t>(qi) * G + g] = {tr.start, tr.end, tr.end - 1};
  }
}

inline float ScaleOf(const float* scale, int stride, int kvh) {
  return scale ? scale[static_cast<int64_t>(kvh) * stride] : 1.0f;
}

// lse consistent with out = acc / (sum + 1e-6): out * exp(lse) = sum_t
// exp(l_t) v_t; -inf when nothing is attended.
inline float LogSumExp(float m, float sum) {
  return sum > 0.0f ? m + std::log(sum + 1e-6f) : -INFINITY;
}

// Per-work-item scratch: the R = q_len * G query rows of one KV head.
struct ItemBuffers {
  std::vector<float> q, acc, m, sum, slopes, logits;
  ItemBuffers(int R, int D)
      : q(static_cast<size_t>(R) * D), acc(static_cast<size_t>(R) * D), m(R), sum(R),
        slopes(R) {}
};

// One work item of V1 or V2: loads the rows' queries, ALiBi slopes and the
// KV head's fp8 scales, and attends each row over its span. Leaves
// m / sum / acc in `b`; returns the V scale the caller applies to acc.
template <typename T, typename TC>
float AttendItem(const PagedAttentionParams& p, int s, int kvh, const RowSpan* rows,
                 ItemBuffers& b) {
  const int G = p.num_heads / p.num_kv_heads, R = p.q_len * G;
  if (p.alibi_slopes)
    for (int r = 0; r < R; ++r) b.slopes[r] = p.alibi_slopes[kvh * G + r % G];
  LoadQueryRows<T>(p, s, kvh, b.q.data());
  const float qk_scale = p.scale * ScaleOf(p.k_scale, p.k_scale_stride, kvh);
  AttendRows<TC>(p, s, kvh, rows, R, qk_scale, p.alibi_slopes ? b.slopes.data() : nullptr,
                 b.q.data(), b.logits, b.acc.data(), b.m.data(), b.sum.data());
  return ScaleOf(p.v_scale, p.v_scale_stride, kvh);
}

template <typename T, typename TC>
void PagedAttentionV1(const PagedAttentionParams& p) {
  const int G = p.num_heads / p.num_kv_heads, D = p.head_size;
  const int R = p.q_len * G;
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  const int64_t work = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size * R * D;
  ParallelFor(items, work, [&](int64_t item) {
    const int s = static_cast<int>(item / p.num_kv_heads);
    const int kvh = static_cast<int>(item % p.num_kv_heads);
    const int L = EffectiveSeqLen(p.seq_lens[s], p.max_blocks_per_seq, p.block_size);
    std::vector<RowSpan> rows;
    RowSpans(p, L, rows);
    ItemBuffers b(R, D);
    const float v_scale = AttendItem<T, TC>(p, s, kvh, rows.data(), b);
    const std::vector<float>&acc = b.acc, &m = b.m, &sum = b.sum;
    for (int r = 0; r < R; ++r) {
      const int64_t row = RowIndex(p, s, kvh, r);
      T* out = static_cast<T*>(p.out) + row * D;
      const float inv = v_scale / (sum[r] + 1e-6f);
      for (int d = 0; d < D; ++d) out[d] = FromFloat<T>(acc[static_cast<size_t>(r) * D + d] * inv);
      if (p.lse) p.lse[row] = LogSumExp(m[r], sum[r]);
    }
  });
}

template <typename T, typename TC>
void PagedAttentionV2(const PagedAttentionParams& p) {
  const int G = p.num_heads / p.num_kv_heads, D = p.head_size;
  const int R = p.q_len * G;
  const int P = p.max_num_partitions, PS = p.partition_size;
  // Phase 1: one item per (sequence, KV head, partition); each row's range
  // is clipped to the partition. Partitions no row reaches do nothing (the
  // reduce reads, per row, only the partitions its range overlaps).
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * P;
  ParallelFor(items, static_cast<int64_t>(PS) * R * D, [&](int64_t item) {
    const int part = static_cast<int>(item % P);
    const int kvh = static_cast<int>((item / P) % p.num_kv_heads);
    const int s = static_cast<int>(item / (static_cast<int64_t>(P) * p.num_kv_heads));
    const int L = EffectiveSeqLen(p.seq_lens[s], p.max_blocks_per_seq, p.block_size);
    std::vector<RowSpan> rows;
    RowSpans(p, L, rows);
    const int p0 = part * PS, p1 = p0 + PS;
    bool any = false;
    for (RowSpan& r : rows) {
      r.lo = std::max(r.lo, p0);
      r.hi = std::min(r.hi, p1);
      any = any || r.hi > r.lo;
    }
    if (!any) return;
    ItemBuffers b(R, D);
    const float v_scale = AttendItem<T, TC>(p, s, kvh, rows.data(), b);
    const std::vector<float>&acc = b.acc, &m = b.m, &sum = b.sum;
    for (int r = 0; r < R; ++r) {
      const int64_t row = RowIndex(p, s, kvh, r) * P + part;
      p.max_logits[row] = m[r];
      p.exp_sums[row] = sum[r];
      const float inv = v_scale / (sum[r] + 1e-6f);
      for (int d = 0; d < D; ++d) p.tmp_out[row * D + d] = acc[static_cast<size_t>(r) * D + d] * inv;
    }
  });
  // Phase 2: exact merge with the global max, per (sequence, position, head),
  // over the partitions the row's range overlaps.
  const int64_t rows = static_cast<int64_t>(p.num_seqs) * p.q_len * p.num_heads;
  ParallelFor(rows, static_cast<int64_t>(P) * D, [&](int64_t r) {
    const int64_t vs = r / p.num_heads;  // s * q_len + qi
    const int s = static_cast<int>(vs / p.q_len), qi = static_cast<int>(vs % p.q_len);
    const int L = EffectiveSeqLen(p.seq_lens[s], p.max_blocks_per_seq, p.block_size);
    const TokenRange tr = QueryRowRange(L, p.q_len, qi, p.sliding_window);
    const int first = tr.start / PS;
    const int last = tr.end > tr.start ? (tr.end + PS - 1) / PS : first;
    float global_max = -FLT_MAX;
    for (int i = first; i < last; ++i) global_max = std::max(global_max, p.max_logits[r * P + i]);
    std::vector<float> acc(D, 0.0f);
    float total = 0.0f;
    for (int i = first; i < last; ++i) {
      const float w = p.exp_sums[r * P + i] * std::exp(p.max_logits[r * P + i] - global_max);
      total += w;
      const float* part_out = p.tmp_out + (r * P + i) * D;
      for (int d = 0; d < D; ++d) acc[d] += w * part_out[d];
    }
    const float inv = 1.0f / (total + 1e-6f);
    T* out = static_cast<T*>(p.out) + r * D;
    for (int d = 0; d < D; ++d) out[d] = FromFloat<T>(acc[d] * inv);
    if (p.lse) p.lse[r] = LogSumExp(global_max, total);
  });
}

// Writes token i's key/value into slot slot_mapping[i]; out-of-range slots
// (negative or >= num_blocks * block_size) are skipped. TIN is the keys'
// storage type, TC the cache's: equal, or TC fp8 with the values quantised
// as sat(value / scale) (round to nearest even).
template <typename TIN, typename TC>
void ReshapeAndCache(const ReshapeAndCacheParams& p) {
  const int D = p.head_size, B = p.block_size;
  constexpr int x = 16 / static_cast<int>(sizeof(TC));
  const int64_t num_slots = p.num_blocks * B;
  ParallelFor(p.num_tokens, static_cast<int64_t>(p.num_kv_heads) * D, [&](int64_t i) {
    const int64_t slot = p.slot_mapping[i];
    if (slot < 0 || slot >= num_slots) return;
    const int64_t block = slot / B;
    const int off = static_cast<int>(slot % B);
    const TIN* key = static_cast<const TIN*>(p.key) + i * p.num_kv_heads * D;
    const TIN* value = static_cast<const TIN*>(p.value) + i * p.num_kv_heads * D;
    TC* kc = static_cast<TC*>(p.key_cache);
    TC* vc = static_cast<TC*>(p.value_cache);
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      const int64_t base = (block * p.num_kv_heads + kvh) * D * B;
      if constexpr (std::is_same_v<TIN, TC>) {
        for (int d = 0; d < D; ++d) {
          kc[base + (static_cast<int64_t>(d / x) * B + off) * x + d % x] = key[kvh * D + d];
          vc[base + static_cast<int64_t>(d) * B + off] = value[kvh * D + d];
        }
      } else {
        const float ks = p.k_scale ? p.k_scale[static_cast<int64_t>(kvh) * p.k_scale_stride] : 1.0f;
        const float vs = p.v_scale ? p.v_scale[static_cast<int64_t>(kvh) * p.v_scale_stride] : 1.0f;
        for (int d = 0; d < D; ++d) {
          kc[base + (static_cast<int64_t>(d / x) * B + off) * x + d % x] =
              FromFloat<TC>(ToFloat(key[kvh * D + d]) / ks);
          vc[base + static_cast<int64_t>(d) * B + off] =
              FromFloat<TC>(ToFloat(value[kvh * D + d]) / vs);
        }
      }
    }
  });
}

// Copies whole blocks src -> dst in both caches, in order; pairs with an id
// outside [0, num_blocks) are skipped. Sequential: later pairs may read what
// earlier pairs wrote (the reference applies the pairs in order too).
inline void CopyBlocks(const CopyBlocksParams& p, int elem_size) {
  const int64_t bytes = p.block_elems * elem_size;
  char* caches[2] = {static_cast<char*>(p.key_cache), static_cast<char*>(p.value_cache)};
  for (int i = 0; i < p.num_pairs; ++i) {
    const int64_t src = p.block_mapping[2 * i], dst = p.block_mapping[2 * i + 1];
    if (src < 0 || src >= p.num_blocks || dst < 0 || dst >= p.num_blocks || src == dst) continue;
    for (char* c : caches) std::memcpy(c + dst * bytes, c + src * bytes, bytes);
  }
}

}  // namespace cpu
}  // namespace jax_paged
