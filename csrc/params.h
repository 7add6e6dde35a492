// Plain parameter structs shared by every kernel (CPU and CUDA).
// Framework-free: nothing here knows about XLA. All tensors are dense,
// row-major, and laid out as documented next to each pointer.
#pragma once

#include <cstdint>

namespace jax_paged {

// Element kinds the kernels are instantiated for. The FFI layer maps XLA
// dtypes to these; each backend maps them to its own C++ storage type.
enum class ScalarKind { kF32, kF16, kBF16 };

// Element kind of the KV cache relative to the query: the query's own dtype
// (the plain case), or an fp8 format, dequantised on read with k_scale /
// v_scale (value * scale) and quantised on write (value / scale, saturating,
// round to nearest even). fp8 caches use x = 16 in the K layout.
enum class CacheKind { kSameAsQuery, kFp8E4M3, kFp8E5M2 };

struct PagedAttentionParams {
  // out          [num_seqs, num_heads, head_size]                 (query dtype)
  void* out = nullptr;
  // query        [num_seqs, num_heads, head_size]
  const void* query = nullptr;
  // key_cache    [num_blocks, num_kv_heads, head_size / x, block_size, x],
  //              x = 16 / sizeof(element)
  const void* key_cache = nullptr;
  // value_cache  [num_blocks, num_kv_heads, head_size, block_size]
  const void* value_cache = nullptr;
  // block_tables [num_seqs, max_blocks_per_seq]  int32, -1 / garbage allowed
  //              past a sequence's last block (never read there).
  const int32_t* block_tables = nullptr;
  // seq_lens     [num_seqs] int32. Effective length is clamped to
  //              [0, max_blocks_per_seq * block_size].
  const int32_t* seq_lens = nullptr;
  // alibi_slopes [num_heads] float32, or nullptr for no ALiBi.
  const float* alibi_slopes = nullptr;

  // V2 only (partitioned): per (seq, head, partition) workspace, allocated
  // by the caller (XLA results), never inside a handler.
  //   exp_sums   [num_seqs, num_heads, max_num_partitions]  float32
  //   max_logits [num_seqs, num_heads, max_num_partitions]  float32
  //   tmp_out    [num_seqs, num_heads, max_num_partitions, head_size] float32
  float* exp_sums = nullptr;
  float* max_logits = nullptr;
  float* tmp_out = nullptr;

  int num_seqs = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  int64_t num_blocks = 0;  // physical blocks in the cache; ids outside
                           // [0, num_blocks) are masked, never read.
  float scale = 1.0f;
  int partition_size = 512;      // V2 tokens per partition (multiple of block_size)
  int max_num_partitions = 1;    // ceil(max_blocks_per_seq * block_size / partition_size)

  // ---- extensions. The defaults give plain decode semantics,
  // so code that fills only the fields above is unaffected. -----------------
  // Multi-token queries: query and out are [num_seqs, q_len, num_heads,
  // head_size]; query row i of sequence s sits at position L - q_len + i and
  // attends tokens [start, end) of QueryRowRange below (causal). The V2
  // workspace and lse then have num_seqs * q_len rows of num_heads.
  int q_len = 1;
  // > 0: logit = soft_cap * tanh(logit / soft_cap), after scale and ALiBi,
  // before masking and softmax. 0: off.
  float soft_cap = 0.0f;
  // > 0: a row attends only its last `sliding_window` tokens. 0: off.
  int sliding_window = 0;
  // Dequantisation scales (fp8 caches only), float32, one per tensor
  // (stride 0) or one per KV head (stride 1); nullptr means 1.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int k_scale_stride = 0;
  int v_scale_stride = 0;
  // Optional log-sum-exp output, float32 [num_seqs, q_len, num_heads]:
  // lse = max + log(sum + 1e-6) (consistent with out's normalisation, so
  // out * exp(lse) = sum_t exp(l_t) v_t), -inf when nothing is attended.
  float* lse = nullptr;
  // dtype of query/out, and of the caches relative to it.
  ScalarKind query_kind = ScalarKind::kF32;
  CacheKind cache_kind = CacheKind::kSameAsQuery;
#ifdef JAX_PAGED_TRACE
  // Trace builds only (CMake -DJAX_PAGED_TRACE=ON): per-CTA timestamps
  // of the grouped kernel, [trace_capacity][kTraceWords] uint64 (see
  // grouped_attention.cuh); CTAs past trace_capacity write nothing.
  unsigned long long* trace = nullptr;
  int trace_capacity = 0;
#endif
};

struct ReshapeAndCacheParams {
  // key, value   [num_tokens, num_kv_heads, head_size]
  const void* key = nullptr;
  const void* value = nullptr;
  // caches as in PagedAttentionParams, updated in place
  void* key_cache = nullptr;
  void* value_cache = nullptr;
  // slot_mapping [num_tokens] int32; slot = block * block_size + offset.
  //              Slots < 0 or >= num_blocks * block_size are skipped.
  const int32_t* slot_mapping = nullptr;
  int num_tokens = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  int block_size = 0;
  int64_t num_blocks = 0;
  // Quantised write (fp8 caches): cache = sat(value / scale), scales as in
  // PagedAttentionParams (nullptr = 1). key/value are then of key_kind.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int k_scale_stride = 0;
  int v_scale_stride = 0;
  ScalarKind key_kind = ScalarKind::kF32;
  CacheKind cache_kind = CacheKind::kSameAsQuery;
};

struct CopyBlocksParams {
  // caches as in PagedAttentionParams, updated in place
  void* key_cache = nullptr;
  void* value_cache = nullptr;
  // block_mapping [num_pairs, 2] int32 (src, dst); pairs with either id
  //               outside [0, num_blocks) are skipped.
  const int32_t* block_mapping = nullptr;
  int num_pairs = 0;
  int64_t num_blocks = 0;
  // Elements of one physical block in each cache
  // (num_kv_heads * head_size * block_size).
  int64_t block_elems = 0;
};

// Effective sequence length used by every kernel and by the reference:
// negative lengths count as 0, lengths past the table's capacity are clamped.
inline
#ifdef __CUDACC__
    __host__ __device__
#endif
    int EffectiveSeqLen(int32_t seq_len, int max_blocks_per_seq, int block_size) {
  const int capacity = max_blocks_per_seq * block_size;
  return seq_len < 0 ? 0 : (seq_len > capacity ? capacity : seq_len);
}

// Tokens [start, end) attended by query row `qi` of a sequence of effective
// length L with q_len new tokens: the row sits at position L - q_len + qi
// (causal: end = that position + 1, at least 0) and, with a sliding window
// w > 0, sees only its last w tokens (start = max(0, end - w)). q_len = 1,
// w = 0 gives the decode case [0, L). ALiBi for the row is
// slope * (t - (end - 1)).
struct TokenRange {
  int start;
  int end;
};
inline
#ifdef __CUDACC__
    __host__ __device__
#endif
    TokenRange QueryRowRange(int L, int q_len, int qi, int sliding_window) {
  int end = L - q_len + 1 + qi;
  if (end < 0) end = 0;
  const int start = (sliding_window > 0 && end > sliding_window) ? end - sliding_window : 0;
  return TokenRange{start, end};
}

}  // namespace jax_paged
