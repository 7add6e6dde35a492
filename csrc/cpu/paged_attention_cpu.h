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
// heads and the q_len query positions share every K/V read, converted to fp32
// once per 64-token chunk and consumed by an online softmax (AttendRows), the
// products on fp32 tiles (cpu_tiles.h). Accumulation is fp32 for all dtypes;
// fp8 caches are decoded through a 256-entry table.
#pragma once

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "params.h"
#include "cpu/cpu_scalar.h"
#include "cpu/cpu_tiles.h"
#include "cpu/parallel.h"

namespace jax_paged {
namespace cpu {

// One work item attends R "rows" (query vectors) that share a KV head: the
// G query heads of the group times the q_len query positions. Row r attends
// tokens [lo, hi) (its causal / sliding-window range, clipped to the V2
// partition) with ALiBi position `pos` (its own position, end - 1).
struct RowSpan {
  int lo, hi, pos;
};

// One chunk of K (dim-major) and V (token-major) in fp32, and a tile's
// logits (AttendRows' scratch).
struct ChunkScratch {
  std::vector<float> kd, vt, s;
  std::vector<uint8_t> ok;  // per chunk token: its block is valid and it is read
};

constexpr int RoundUpTo(int v, int m) { return (v + m - 1) / m * m; }
// The rows' queries and accumulators are [RoundUpTo(R, kRowTile)][RowStride(D)]
// floats, zero in the padding (rows of a last partial tile, dims up to a
// multiple of kDimTile), so that the tile products need no edge cases.
constexpr int RowStride(int head_size) { return RoundUpTo(head_size, kDimTile); }

// Tokens [a, b) of one block's K ([D/x][B][x] as stored) into the chunk's
// dim-major fp32 keys kd[d][t] (row stride kChunk, kd pointing at the block's
// first token): contiguous loads, a store per element. Compiled for AVX-512 /
// AVX2 too (cpu_tiles.h).
template <typename TC>
JAX_PAGED_CPU_CLONES static void KeysToChunk(const TC* __restrict kb, int D, int B, int a, int b,
                                             float* __restrict kd) {
  constexpr int x = 16 / static_cast<int>(sizeof(TC));
  for (int c = 0; c < D / x; ++c)
    for (int off = a; off < b; ++off) {
      const TC* src = kb + (static_cast<int64_t>(c) * B + off) * x;
      float* dst = kd + static_cast<size_t>(c) * x * kChunk + off;
      for (int i = 0; i < x; ++i) dst[static_cast<size_t>(i) * kChunk] = ToFloat(src[i]);
    }
}

// Tokens [a, b) of one block's V ([D][B] as stored) into the chunk's
// token-major fp32 values vt[t][d] (row stride `stride`, vt pointing at the
// block's first token). 16-bit and f32 values go in 8 x 8 tiles (D is a
// multiple of 8), baseline x86-64 (an AVX-512 form was no faster, so this is not
// cloned). fp8 values, decoded through a table, stay token by token, which the
// tiles did not beat.
template <typename TC>
void ValuesToChunk(const TC* __restrict vb, int D, int B, int a, int b, float* __restrict vt,
                   int stride) {
  int o0 = a;
  if constexpr (!kIsFp8<TC>) {
    for (; o0 + 8 <= b; o0 += 8)
      for (int d0 = 0; d0 < D; d0 += 8) {
        float tile[8][8];
        for (int i = 0; i < 8; ++i)
          for (int j = 0; j < 8; ++j)
            tile[i][j] = ToFloat(vb[static_cast<int64_t>(d0 + i) * B + o0 + j]);
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 8; ++i) vt[static_cast<size_t>(o0 + j) * stride + d0 + i] = tile[i][j];
      }
  }
  for (; o0 < b; ++o0)
    for (int d = 0; d < D; ++d)
      vt[static_cast<size_t>(o0) * stride + d] = ToFloat(vb[static_cast<int64_t>(d) * B + o0]);
}

// Attention of one work item over its rows. q and acc are padded row-major
// (RowStride). Outputs, per row r: m[r] the max logit (-FLT_MAX if no token is
// valid), sum[r] the sum of exp(logit - m), acc[r * RowStride(D) + d] the
// unnormalised sum of exp(logit - m) * v (v not yet multiplied by v_scale). TC is the cache's storage type (the query's, or
// fp8); `qk_scale` = scale * k_scale of this KV head.
//
// One pass over the union of the rows' ranges in chunks of kChunk tokens
// (whole blocks): each chunk's K and V are converted to fp32 once, then every
// tile of kRowTile rows takes its logits (LogitsTile), folds them into its
// running max / sum (online softmax: the accumulators are rescaled when the
// max rises, so the result is the two-pass softmax's with the row's global
// max) and adds P.V (ValuesTile; a lone row, as in MHA decode, takes the
// 1-row forms LogitsRow / ValuesRow). Memory stays O(rows * head_size) however
// long the sequence. Only tokens inside the union and in valid blocks are
// read; all others are zero in the chunk and get probability 0, so NaN in
// unused slots cannot leak in.
template <typename TC>
void AttendRows(const PagedAttentionParams& p, int s, int kvh, const RowSpan* rows, int R,
                float qk_scale, const float* slopes /* [R] or nullptr */,
                const float* q /* padded, converted */, ChunkScratch& w, float* acc, float* m,
                float* sum) {
  const int D = p.head_size, B = p.block_size;
  const int Dp = RowStride(D);
  std::fill(acc, acc + static_cast<size_t>(RoundUpTo(R, kRowTile)) * Dp, 0.0f);
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

  w.kd.assign(static_cast<size_t>(D) * kChunk, 0.0f);
  w.vt.assign(static_cast<size_t>(kChunk) * Dp, 0.0f);  // padding dims stay 0
  w.s.assign(static_cast<size_t>(kRowTile) * kChunk, 0.0f);
  w.ok.assign(kChunk, 0);
  float* kd = w.kd.data();
  float* vt = w.vt.data();
  float* sc = w.s.data();

  const TC* kc = static_cast<const TC*>(p.key_cache);
  const TC* vc = static_cast<const TC*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(s) * p.max_blocks_per_seq;
  const int64_t block_stride = static_cast<int64_t>(p.num_kv_heads) * D * B;
  const bool cap = p.soft_cap > 0.0f;
  const float inv_cap = cap ? 1.0f / p.soft_cap : 0.0f;

  for (int c0 = t0 / kChunk * kChunk; c0 < t1; c0 += kChunk) {
    const int lo = std::max(t0, c0) - c0, hi = std::min(t1, c0 + kChunk) - c0;  // chunk coords
    // The chunk's K and V in fp32; tokens not read (outside the union, or in
    // a block whose id is out of range: masked) are zero.
    std::fill(w.ok.begin(), w.ok.end(), 0);
    for (int j = (c0 + lo) / B; j <= (c0 + hi - 1) / B; ++j) {
      const int64_t block = table[j];
      if (block < 0 || block >= p.num_blocks) continue;
      const int base = j * B - c0;  // chunk coordinate of the block's first token
      const int a = std::max(lo, base) - base, b = std::min(hi, base + B) - base;
      const TC* kb = kc + block * block_stride + static_cast<int64_t>(kvh) * D * B;
      const TC* vb = vc + block * block_stride + static_cast<int64_t>(kvh) * D * B;
      KeysToChunk(kb, D, B, a, b, kd + base);
      ValuesToChunk(vb, D, B, a, b, vt + static_cast<size_t>(base) * Dp, Dp);
      std::fill(w.ok.begin() + base + a, w.ok.begin() + base + b, 1);
    }
    for (int t = lo; t < hi; ++t)
      if (!w.ok[t]) {
        for (int d = 0; d < D; ++d) kd[static_cast<size_t>(d) * kChunk + t] = 0.0f;
        std::fill(vt + static_cast<size_t>(t) * Dp, vt + static_cast<size_t>(t + 1) * Dp, 0.0f);
      }

    for (int r0 = 0; r0 < R; r0 += kRowTile) {
      // The tile's tokens in this chunk: the union of its rows' ranges.
      int tlo = kChunk, thi = 0;
      for (int r = r0; r < std::min(R, r0 + kRowTile); ++r) {
        const int a = std::max(rows[r].lo - c0, lo), b = std::min(rows[r].hi - c0, hi);
        if (a < b) {
          tlo = std::min(tlo, a);
          thi = std::max(thi, b);
        }
      }
      if (tlo >= thi) continue;
      const int tb0 = tlo / kTokTile * kTokTile, tb1 = RoundUpTo(thi, kTokTile);
      // A tile of one row (MHA decode, or the last of 4k + 1 rows) is computed
      // alone; other tiles compute kRowTile rows (padding rows: zero queries,
      // probability 0).
      const bool one_row = R - r0 == 1;
      if (one_row)
        LogitsRow(q + static_cast<size_t>(r0) * Dp, kd, D, tb0, tb1, sc);
      else
        LogitsTile(q + static_cast<size_t>(r0) * Dp, Dp, kd, D, tb0, tb1, sc);
      for (int i = 0; i < (one_row ? 1 : kRowTile); ++i) {
        const int r = r0 + i;
        float* pr = sc + i * kChunk;
        const int a = r < R ? std::max(rows[r].lo - c0, lo) : 0;
        const int b = r < R ? std::min(rows[r].hi - c0, hi) : 0;
        // Logits of the row's valid tokens, -inf for masked ones; the
        // tile's other tokens get probability 0.
        float cmax = -INFINITY;
        for (int t = tlo; t < thi; ++t) {
          if (t < a || t >= b) {
            pr[t] = 0.0f;
            continue;
          }
          if (!w.ok[t]) {
            pr[t] = -INFINITY;
            continue;
          }
          float logit = qk_scale * pr[t];
          if (slopes) logit += slopes[r] * static_cast<float>(c0 + t - rows[r].pos);
          if (cap) logit = p.soft_cap * std::tanh(logit * inv_cap);
          pr[t] = logit;
          cmax = std::max(cmax, logit);
        }
        if (a >= b) continue;
        if (cmax > m[r]) {  // the running max rises: rescale what is summed so far
          const float factor = std::exp(m[r] - cmax);
          sum[r] *= factor;
          float* ar = acc + static_cast<size_t>(r) * Dp;
          for (int d = 0; d < Dp; ++d) ar[d] *= factor;
          m[r] = cmax;
        }
        sum[r] += ExpShiftedSum(pr, a, b, m[r]);  // masked tokens: exp(-inf) = 0
      }
      float* tile_acc = acc + static_cast<size_t>(r0) * Dp;
      if (one_row)
        ValuesRow(sc, vt, Dp, Dp, tlo, thi, tile_acc);
      else
        ValuesTile(sc, vt, Dp, Dp, tlo, thi, tile_acc);
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

// The item's query rows into q (padded, RowStride; the padding stays as is).
template <typename T>
void LoadQueryRows(const PagedAttentionParams& p, int s, int kvh, float* q) {
  const int R = p.q_len * (p.num_heads / p.num_kv_heads), D = p.head_size;
  const T* query = static_cast<const T*>(p.query);
  for (int r = 0; r < R; ++r) {
    const T* src = query + RowIndex(p, s, kvh, r) * D;
    for (int d = 0; d < D; ++d) q[static_cast<size_t>(r) * RowStride(D) + d] = ToFloat(src[d]);
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

// Per-work-item scratch: the R = q_len * G query rows of one KV head (q and
// acc padded: RowStride, zero-initialised).
struct ItemBuffers {
  std::vector<float> q, acc, m, sum, slopes;
  ChunkScratch scratch;
  ItemBuffers(int R, int D)
      : q(static_cast<size_t>(RoundUpTo(R, kRowTile)) * RowStride(D)), acc(q.size()), m(R),
        sum(R), slopes(R) {}
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
                 b.q.data(), b.scratch, b.acc.data(), b.m.data(), b.sum.data());
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
      const float* ar = acc.data() + static_cast<size_t>(r) * RowStride(D);
      for (int d = 0; d < D; ++d) out[d] = FromFloat<T>(ar[d] * inv);
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
      const float* ar = acc.data() + static_cast<size_t>(r) * RowStride(D);
      for (int d = 0; d < D; ++d) p.tmp_out[row * D + d] = ar[d] * inv;
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
