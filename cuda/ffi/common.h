// The thin FFI layer shared by the CPU and CUDA handlers: unpack XLA buffers
// into the framework-free parameter structs, check every shape and dtype, and
// dispatch on the element type in exactly one place.
//
// The Python primitives already validate at trace time; these checks are the
// last line of defence for anyone calling the custom calls directly, so a bad
// buffer becomes an ffi::Error instead of an out-of-bounds access.
#pragma once

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "../kernels/params.h"

namespace jax_paged {
namespace ffi = xla::ffi;

inline std::string DimsToString(ffi::AnyBuffer::Dimensions dims) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

inline ffi::Error ArgError(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_paged: " + what);
}

// Maps an XLA float dtype to a ScalarKind; false for anything else.
inline bool ToScalarKind(ffi::DataType dt, ScalarKind* kind) {
  switch (dt) {
    case ffi::DataType::F32: *kind = ScalarKind::kF32; return true;
    case ffi::DataType::F16: *kind = ScalarKind::kF16; return true;
    case ffi::DataType::BF16: *kind = ScalarKind::kBF16; return true;
    default: return false;
  }
}

template <ScalarKind K>
using ScalarTag = std::integral_constant<ScalarKind, K>;

// The single dtype dispatch: calls f(ScalarTag<K>{}) for the kind. Each
// backend turns the tag into its own storage type (CpuScalar / CudaScalar).
template <typename F>
ffi::Error DispatchScalar(ScalarKind kind, F&& f) {
  switch (kind) {
    case ScalarKind::kF32: return f(ScalarTag<ScalarKind::kF32>{});
    case ScalarKind::kF16: return f(ScalarTag<ScalarKind::kF16>{});
    case ScalarKind::kBF16: return f(ScalarTag<ScalarKind::kBF16>{});
  }
  return ArgError("unsupported element type");
}

inline int ElemSize(ScalarKind kind) { return kind == ScalarKind::kF32 ? 4 : 2; }

// Unpacks and checks the paged-attention operands. `alibi` may have zero
// elements, meaning no ALiBi.
inline ffi::Error UnpackPagedAttention(ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                                       ffi::AnyBuffer value_cache,
                                       ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                                       ffi::AnyBuffer alibi, ffi::AnyBuffer out,
                                       PagedAttentionParams* p, ScalarKind* kind) {
  auto q = query.dimensions();
  auto kc = key_cache.dimensions();
  auto vc = value_cache.dimensions();
  auto bt = block_tables.dimensions();
  auto sl = seq_lens.dimensions();
  if (!ToScalarKind(query.element_type(), kind))
    return ArgError("query must be float32, float16 or bfloat16");
  if (key_cache.element_type() != query.element_type() ||
      value_cache.element_type() != query.element_type() ||
      out.element_type() != query.element_type())
    return ArgError("key_cache, value_cache and out must have the query's dtype");
  if (q.size() != 3) return ArgError("query must be 3-D, got " + DimsToString(q));
  const int64_t x = 16 / ElemSize(*kind);
  if (kc.size() != 5) return ArgError("key_cache must be 5-D, got " + DimsToString(kc));
  if (vc.size() != 4) return ArgError("value_cache must be 4-D, got " + DimsToString(vc));
  const int64_t num_seqs = q[0], num_heads = q[1], head_size = q[2];
  const int64_t num_blocks = kc[0], num_kv_heads = kc[1], block_size = kc[3];
  if (kc[4] != x || kc[2] * x != head_size)
    return ArgError("key_cache " + DimsToString(kc) + " does not match head_size " +
                    std::to_string(head_size) + " with x=" + std::to_string(x));
  if (vc[0] != num_blocks || vc[1] != num_kv_heads || vc[2] != head_size ||
      vc[3] != block_size)
    return ArgError("value_cache " + DimsToString(vc) + " disagrees with key_cache " +
                    DimsToString(kc));
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0)
    return ArgError("num_heads must be a positive multiple of num_kv_heads");
  if (block_tables.element_type() != ffi::DataType::S32 || bt.size() != 2 ||
      bt[0] != num_seqs)
    return ArgError("block_tables must be int32 [num_seqs, max_blocks_per_seq], got " +
                    DimsToString(bt));
  if (seq_lens.element_type() != ffi::DataType::S32 || sl.size() != 1 ||
      sl[0] != num_seqs)
    return ArgError("seq_lens must be int32 [num_seqs], got " + DimsToString(sl));
  const bool has_alibi = alibi.element_count() > 0;
  if (has_alibi && (alibi.element_type() != ffi::DataType::F32 ||
                    static_cast<int64_t>(alibi.element_count()) != num_heads))
    return ArgError("alibi_slopes must be float32 [num_heads]");
  if (out.dimensions().size() != 3 || static_cast<int64_t>(out.element_count()) !=
                                          num_seqs * num_heads * head_size)
    return ArgError("out must have the query's shape");
  if (head_size % 8 != 0 || head_size > 256 || head_size <= 0)
    return ArgError("head_size must be a multiple of 8 up to 256, got " +
                    std::to_string(head_size));
  if (block_size <= 0 || block_size > 256)
    return ArgError("block_size must be in [1, 256], got " + std::to_string(block_size));

  p->out = out.untyped_data();
  p->query = query.untyped_data();
  p->key_cache = key_cache.untyped_data();
  p->value_cache = value_cache.untyped_data();
  p->block_tables = reinterpret_cast<const int32_t*>(block_tables.untyped_data());
  p->seq_lens = reinterpret_cast<const int32_t*>(seq_lens.untyped_data());
  p->alibi_slopes = has_alibi ? reinterpret_cast<const float*>(alibi.untyped_data()) : nullptr;
  p->num_seqs = static_cast<int>(num_seqs);
  p->num_heads = static_cast<int>(num_heads);
  p->num_kv_heads = static_cast<int>(num_kv_heads);
  p->head_size = static_cast<int>(head_size);
  p->block_size = static_cast<int>(block_size);
  p->max_blocks_per_seq = static_cast<int>(bt[1]);
  p->num_blocks = num_blocks;
  return ffi::Error::Success();
}

// Checks the V2 workspace results and the partition size, fills p.
inline ffi::Error UnpackPartitions(int64_t partition_size, ffi::AnyBuffer exp_sums,
                                   ffi::AnyBuffer max_logits, ffi::AnyBuffer tmp_out,
                                   PagedAttentionParams* p) {
  if (partition_size <= 0 || partition_size % p->block_size != 0)
    return ArgError("partition_size must be a positive multiple of block_size (" +
                    std::to_string(p->block_size) + "), got " +
                    std::to_string(partition_size));
  const int64_t capacity = int64_t{p->max_blocks_per_seq} * p->block_size;
  const int64_t parts = std::max<int64_t>(1, (capacity + partition_size - 1) / partition_size);
  const int64_t rows = int64_t{p->num_seqs} * p->num_heads * parts;
  if (exp_sums.element_type() != ffi::DataType::F32 ||
      max_logits.element_type() != ffi::DataType::F32 ||
      tmp_out.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(exp_sums.element_count()) != rows ||
      static_cast<int64_t>(max_logits.element_count()) != rows ||
      static_cast<int64_t>(tmp_out.element_count()) != rows * p->head_size)
    return ArgError("V2 workspace results have the wrong shape or dtype");
  p->partition_size = static_cast<int>(partition_size);
  p->max_num_partitions = static_cast<int>(parts);
  p->exp_sums = reinterpret_cast<float*>(exp_sums.untyped_data());
  p->max_logits = reinterpret_cast<float*>(max_logits.untyped_data());
  p->tmp_out = reinterpret_cast<float*>(tmp_out.untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error UnpackReshapeAndCache(ffi::AnyBuffer key, ffi::AnyBuffer value,
                                        ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                        ffi::AnyBuffer slot_mapping,
                                        ffi::Result<ffi::AnyBuffer> key_cache_out,
                                        ffi::Result<ffi::AnyBuffer> value_cache_out,
                                        ReshapeAndCacheParams* p, ScalarKind* kind) {
  auto k = key.dimensions();
  auto kc = key_cache.dimensions();
  auto vc = value_cache.dimensions();
  if (!ToScalarKind(key_cache.element_type(), kind))
    return ArgError("key_cache must be float32, float16 or bfloat16");
  if (key.element_type() != key_cache.element_type() ||
      value.element_type() != key_cache.element_type() ||
      value_cache.element_type() != key_cache.element_type())
    return ArgError("key, value and value_cache must have key_cache's dtype");
  if (k.size() != 3 || value.dimensions().size() != 3 ||
      key.element_count() != value.element_count())
    return ArgError("key and value must be [num_tokens, num_kv_heads, head_size], got " +
                    DimsToString(k) + " and " + DimsToString(value.dimensions()));
  const int64_t x = 16 / ElemSize(*kind);
  if (kc.size() != 5 || vc.size() != 4 || kc[1] != k[1] || kc[2] * x != k[2] || kc[4] != x ||
      vc[0] != kc[0] || vc[1] != k[1] || vc[2] != k[2] || vc[3] != kc[3])
    return ArgError("caches " + DimsToString(kc) + " / " + DimsToString(vc) +
                    " do not match key " + DimsToString(k));
  if (slot_mapping.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(slot_mapping.element_count()) != k[0])
    return ArgError("slot_mapping must be int32 [num_tokens]");
  // In-place update: the results alias the cache operands (Python lowers with
  // operand_output_aliases); if XLA ever hands us distinct buffers we would
  // silently drop the rest of the cache, so refuse.
  if (key_cache_out->untyped_data() != key_cache.untyped_data() ||
      value_cache_out->untyped_data() != value_cache.untyped_data())
    return ArgError("reshape_and_cache expects its cache results to alias its cache operands");
  p->key = key.untyped_data();
  p->value = value.untyped_data();
  p->key_cache = key_cache_out->untyped_data();
  p->value_cache = value_cache_out->untyped_data();
  p->slot_mapping = reinterpret_cast<const int32_t*>(slot_mapping.untyped_data());
  p->num_tokens = static_cast<int>(k[0]);
  p->num_kv_heads = static_cast<int>(k[1]);
  p->head_size = static_cast<int>(k[2]);
  p->block_size = static_cast<int>(kc[3]);
  p->num_blocks = kc[0];
  return ffi::Error::Success();
}

inline ffi::Error UnpackCopyBlocks(ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                   ffi::AnyBuffer block_mapping,
                                   ffi::Result<ffi::AnyBuffer> key_cache_out,
                                   ffi::Result<ffi::AnyBuffer> value_cache_out,
                                   CopyBlocksParams* p, ScalarKind* kind) {
  auto kc = key_cache.dimensions();
  auto bm = block_mapping.dimensions();
  if (!ToScalarKind(key_cache.element_type(), kind) ||
      value_cache.element_type() != key_cache.element_type())
    return ArgError("caches must share a float32, float16 or bfloat16 dtype");
  if (kc.size() != 5 || key_cache.element_count() != value_cache.element_count())
    return ArgError("key_cache and value_cache disagree");
  if (block_mapping.element_type() != ffi::DataType::S32 || bm.size() != 2 || bm[1] != 2)
    return ArgError("block_mapping must be int32 [num_pairs, 2], got " + DimsToString(bm));
  if (key_cache_out->untyped_data() != key_cache.untyped_data() ||
      value_cache_out->untyped_data() != value_cache.untyped_data())
    return ArgError("copy_blocks expects its cache results to alias its cache operands");
  p->key_cache = key_cache_out->untyped_data();
  p->value_cache = value_cache_out->untyped_data();
  p->block_mapping = reinterpret_cast<const int32_t*>(block_mapping.untyped_data());
  p->num_pairs = static_cast<int>(bm[0]);
  p->num_blocks = kc[0];
  p->block_elems = kc[0] == 0 ? 0 : static_cast<int64_t>(key_cache.element_count()) / kc[0];
  return ffi::Error::Success();
}

}  // namespace jax_paged
