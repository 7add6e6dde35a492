// CPU PagedAttention (V1 and V2) and cache kernels, with the same semantics
// as the CUDA kernels and jax_paged/reference.py:
//   L = EffectiveSeqLen(seq_len); kv head = h / (num_heads / num_kv_heads)
//   logit_t = scale * q.k_t + slope[h] * (t - (L - 1))        (t < L)
//   tokens whose physical block id is outside [0, num_blocks) are masked
//   p_t = exp(logit_t - max) / (sum + 1e-6)
// One work item is a (sequence, KV head[, partition]): the group's query
// heads share every K/V read. Accumulation is fp32 for all dtypes.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../kernels/params.h"
#include "cpu_scalar.h"
#include "parallel.h"

namespace jax_paged {
namespace cpu {

// Attention of one (sequence, KV head) group over tokens [t0, t1) of a
// sequence of effective length L (t1 <= L). Outputs, per group head g:
// m[g] the max logit (-FLT_MAX if no token is valid), sum[g] the sum of
// exp(logit - m), acc[g*D + d] the unnormalised sum of exp(logit - m) * v.
template <typename T>
void AttendGroup(const PagedAttentionParams& p, int s, int kvh, int t0, int t1, int L,
                 const float* q /* [G, D], converted */, std::vector<float>& logits,
                 float* acc, float* m, float* sum) {
  const int G = p.num_heads / p.num_kv_heads;
  const int D = p.head_size, B = p.block_size;
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  const int n = t1 - t0;
  logits.assign(static_cast<size_t>(G) * std::max(n, 0), -INFINITY);
  std::fill(acc, acc + G * D, 0.0f);
  for (int g = 0; g < G; ++g) { m[g] = -FLT_MAX; sum[g] = 0.0f; }
  if (n <= 0) return;

  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(s) * p.max_blocks_per_seq;
  const int64_t block_stride = static_cast<int64_t>(p.num_kv_heads) * D * B;
  // One block of K (as stored: [D/x][B][x]) and of V (transposed to [B][D])
  // in fp32, converted once and shared by the group's G query heads; both
  // inner loops then run over contiguous floats and vectorise.
  std::vector<float> kf(static_cast<size_t>(D) * B), vt(static_cast<size_t>(D) * B);
  std::vector<float> partial(static_cast<size_t>(B) * x);

  // Pass 1: logits and running max.
  for (int j = t0 / B; j <= (t1 - 1) / B; ++j) {
    const int64_t block = table[j];
    if (block < 0 || block >= p.num_blocks) continue;  // masked: stays -inf
    const int off0 = std::max(t0, j * B) - j * B;
    const int off1 = std::min(t1, (j + 1) * B) - j * B;
    const T* kb = kc + block * block_stride + static_cast<int64_t>(kvh) * D * B;
    for (int c = 0; c < D / x; ++c)
      for (int e = off0 * x; e < off1 * x; ++e)
        kf[static_cast<size_t>(c) * B * x + e] = ToFloat(kb[static_cast<int64_t>(c) * B * x + e]);
    for (int g = 0; g < G; ++g) {
      const int h = kvh * G + g;
      std::fill(partial.begin(), partial.end(), 0.0f);
      for (int c = 0; c < D / x; ++c) {
        const float* qc = q + g * D + c * x;
        const float* kcf = kf.data() + static_cast<size_t>(c) * B * x;
        for (int off = off0; off < off1; ++off)
          for (int i = 0; i < x; ++i) partial[off * x + i] += qc[i] * kcf[off * x + i];
      }
      for (int off = off0; off < off1; ++off) {
        float dot = 0.0f;
        for (int i = 0; i < x; ++i) dot += partial[off * x + i];
        const int t = j * B + off;
        float logit = p.scale * dot;
        if (p.alibi_slopes) logit += p.alibi_slopes[h] * static_cast<float>(t - (L - 1));
        logits[static_cast<size_t>(g) * n + (t - t0)] = logit;
        m[g] = std::max(m[g], logit);
      }
    }
  }
  // Pass 2: exp and sum (masked tokens are -inf and give exactly 0).
  for (int g = 0; g < G; ++g) {
    float* lg = logits.data() + static_cast<size_t>(g) * n;
    for (int i = 0; i < n; ++i) {
      lg[i] = std::exp(lg[i] - m[g]);
      sum[g] += lg[i];
    }
  }
  // Pass 3: P.V over valid tokens only (the stale tail of the last block is
  // never converted or read, so NaN there cannot leak in).
  for (int j = t0 / B; j <= (t1 - 1) / B; ++j) {
    const int64_t block = table[j];
    if (block < 0 || block >= p.num_blocks) continue;
    const int off0 = std::max(t0, j * B) - j * B;
    const int off1 = std::min(t1, (j + 1) * B) - j * B;
    const T* vb = vc + block * block_stride + static_cast<int64_t>(kvh) * D * B;
    for (int d = 0; d < D; ++d)
      for (int off = off0; off < off1; ++off)
        vt[static_cast<size_t>(off) * D + d] = ToFloat(vb[static_cast<int64_t>(d) * B + off]);
    for (int g = 0; g < G; ++g) {
      const float* pg = logits.data() + static_cast<size_t>(g) * n + (j * B - t0);
      float* ag = acc + g * D;
      for (int off = off0; off < off1; ++off) {
        const float pv = pg[off];
        const float* row = vt.data() + static_cast<size_t>(off) * D;
        for (int d = 0; d < D; ++d) ag[d] += pv * row[d];
      }
    }
  }
}

template <typename T>
void LoadQueryGroup(const PagedAttentionParams& p, int s, int kvh, float* q) {
  const int G = p.num_heads / p.num_kv_heads, D = p.head_size;
  const T* src = static_cast<const T*>(p.query) +
                 (static_cast<int64_t>(s) * p.num_heads + kvh * G) * D;
  for (int i = 0; i < G * D; ++i) q[i] = ToFloat(src[i]);
}

template <typename T>
void PagedAttentionV1(const PagedAttentionParams& p) {
  const int G = p.num_heads / p.num_kv_heads, D = p.head_size;
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads;
  const int64_t work = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size * G * D;
  ParallelFor(items, work, [&](int64_t item) {
    const int s = static_cast<int>(item / p.num_kv_heads);
    const int kvh = static_cast<int>(item % p.num_kv_heads);
    const int L = EffectiveSeqLen(p.seq_lens[s], p.max_blocks_per_seq, p.block_size);
    std::vector<float> q(G * D), acc(G * D), m(G), sum(G), logits;
    LoadQueryGroup<T>(p, s, kvh, q.data());
    AttendGroup<T>(p, s, kvh, 0, L, L, q.data(), logits, acc.data(), m.data(), sum.data());
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(s) * p.num_heads + kvh * G) * D;
    for (int g = 0; g < G; ++g) {
      const float inv = 1.0f / (sum[g] + 1e-6f);
      for (int d = 0; d < D; ++d) out[g * D + d] = FromFloat<T>(acc[g * D + d] * inv);
    }
  });
}

template <typename T>
void PagedAttentionV2(const PagedAttentionParams& p) {
  const int G = p.num_heads / p.num_kv_heads, D = p.head_size;
  const int P = p.max_num_partitions, PS = p.partition_size;
  // Phase 1: one item per (sequence, KV head, partition). Partitions that
  // start at or past L do nothing; the reduce never reads them.
  const int64_t items = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * P;
  ParallelFor(items, static_cast<int64_t>(PS) * G * D, [&](int64_t item) {
    const int part = static_cast<int>(item % P);
    const int kvh = static_cast<int>((item / P) % p.num_kv_heads);
    const int s = static_cast<int>(item / (static_cast<int64_t>(P) * p.num_kv_heads));
    const int L = EffectiveSeqLen(p.seq_lens[s], p.max_blocks_per_seq, p.block_size);
    const int t0 = part * PS, t1 = std::min(L, t0 + PS);
    if (t0 >= L) return;
    std::vector<float> q(G * D), acc(G * D), m(G), sum(G), logits;
    LoadQueryGroup<T>(p, s, kvh, q.data());
    AttendGroup<T>(p, s, kvh, t0, t1, L, q.data(), logits, acc.data(), m.data(), sum.data());
    for (int g = 0; g < G; ++g) {
      const int64_t row = (static_cast<int64_t>(s) * p.num_heads + kvh * G + g) * P + part;
      p.max_logits[row] = m[g];
      p.exp_sums[row] = sum[g];
      const float inv = 1.0f / (sum[g] + 1e-6f);
      for (int d = 0; d < D; ++d) p.tmp_out[row * D + d] = acc[g * D + d] * inv;
    }
  });
  // Phase 2: exact merge with the global max, per (sequence, head).
  const int64_t rows = static_cast<int64_t>(p.num_seqs) * p.num_heads;
  ParallelFor(rows, static_cast<int64_t>(P) * D, [&](int64_t r) {
    const int s = static_cast<int>(r / p.num_heads);
    const int L = EffectiveSeqLen(p.seq_lens[s], p.max_blocks_per_seq, p.block_size);
    const int parts = (L + PS - 1) / PS;
    float global_max = -FLT_MAX;
    for (int i = 0; i < parts; ++i) global_max = std::max(global_max, p.max_logits[r * P + i]);
    std::vector<float> acc(D, 0.0f);
    float total = 0.0f;
    for (int i = 0; i < parts; ++i) {
      const float w = p.exp_sums[r * P + i] * std::exp(p.max_logits[r * P + i] - global_max);
      total += w;
      const float* part_out = p.tmp_out + (r * P + i) * D;
      for (int d = 0; d < D; ++d) acc[d] += w * part_out[d];
    }
    const float inv = 1.0f / (total + 1e-6f);
    T* out = static_cast<T*>(p.out) + r * D;
    for (int d = 0; d < D; ++d) out[d] = FromFloat<T>(acc[d] * inv);
  });
}

// Writes token i's key/value into slot slot_mapping[i]; out-of-range slots
// (negative or >= num_blocks * block_size) are skipped.
template <typename T>
void ReshapeAndCache(const ReshapeAndCacheParams& p) {
  const int D = p.head_size, B = p.block_size;
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  const int64_t num_slots = p.num_blocks * B;
  ParallelFor(p.num_tokens, static_cast<int64_t>(p.num_kv_heads) * D, [&](int64_t i) {
    const int64_t slot = p.slot_mapping[i];
    if (slot < 0 || slot >= num_slots) return;
    const int64_t block = slot / B;
    const int off = static_cast<int>(slot % B);
    const T* key = static_cast<const T*>(p.key) + i * p.num_kv_heads * D;
    const T* value = static_cast<const T*>(p.value) + i * p.num_kv_heads * D;
    T* kc = static_cast<T*>(p.key_cache);
    T* vc = static_cast<T*>(p.value_cache);
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      const int64_t base = (block * p.num_kv_heads + kvh) * D * B;
      for (int d = 0; d < D; ++d) {
        kc[base + (static_cast<int64_t>(d / x) * B + off) * x + d % x] = key[kvh * D + d];
        vc[base + static_cast<int64_t>(d) * B + off] = value[kvh * D + d];
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
