// Plain parameter structs shared by every kernel (CPU and CUDA).
// Framework-free: nothing here knows about XLA. All tensors are dense,
// row-major, and laid out as documented next to each pointer.
#pragma once

#include <cstdint>

namespace jax_paged {

// Element kinds the kernels are instantiated for. The FFI layer maps XLA
// dtypes to these; each backend maps them to its own C++ storage type.
enum class ScalarKind { kF32, kF16, kBF16 };

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

}  // namespace jax_paged
