// The thin FFI layer shared by the CPU and CUDA handlers: unpack XLA buffers
// into the framework-free parameter structs, check every shape and dtype, and
// dispatch on the element type in exactly one place.
//
// The Python primitives already validate at trace time; these checks are the
// last line of defence for anyone calling the custom calls directly, so a bad
// buffer becomes an ffi::Error instead of an out-of-bounds access.
#pragma once

#include <algorithm>
#include <cmath>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

#include "ffi/xla_ffi.h"
#include "params.h"
#include "sizes.h"

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

// The parameter structs hold sizes and attributes as int: a value that does not
// fit is refused with an error naming it, never narrowed (a narrowed partition
// size of 2^32 would be 0, a division by zero in the kernels).
inline bool FitsInt(int64_t v) { return v >= 0 && v <= INT_MAX; }

inline ffi::Error IntRangeError(const std::string& name, int64_t v) {
  return ArgError(name + " must be in [0, 2^31), got " + std::to_string(v));
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

// Maps an XLA fp8 dtype to a CacheKind; false for anything else.
inline bool ToFp8Kind(ffi::DataType dt, CacheKind* kind) {
  switch (dt) {
    case ffi::DataType::F8E4M3FN: *kind = CacheKind::kFp8E4M3; return true;
    case ffi::DataType::F8E5M2: *kind = CacheKind::kFp8E5M2; return true;
    default: return false;
  }
}

template <CacheKind K>
using CacheTag = std::integral_constant<CacheKind, K>;

// The fp8 half of the dtype dispatch: calls f(CacheTag<K>{}) for an fp8 kind.
// Each backend maps the tag to its storage type (CpuFp8 / CudaFp8).
template <typename F>
ffi::Error DispatchFp8(CacheKind kind, F&& f) {
  switch (kind) {
    case CacheKind::kFp8E4M3: return f(CacheTag<CacheKind::kFp8E4M3>{});
    case CacheKind::kFp8E5M2: return f(CacheTag<CacheKind::kFp8E5M2>{});
    case CacheKind::kSameAsQuery: break;
  }
  return ArgError("not an fp8 cache kind");
}

// Bytes of one cache element.
inline int CacheElemSize(ScalarKind query_kind, CacheKind cache_kind) {
  return cache_kind == CacheKind::kSameAsQuery ? ElemSize(query_kind) : 1;
}

namespace detail {

// Shared by UnpackPagedAttention (the seed's contract: 3-D query, caches of
// the query's dtype) and UnpackPagedAttentionExt (also 4-D multi-token
// queries and fp8 caches).
inline ffi::Error UnpackAttentionCore(ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                                      ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                                      ffi::AnyBuffer seq_lens, ffi::AnyBuffer alibi,
                                      ffi::AnyBuffer out, bool extended,
                                      PagedAttentionParams* p, ScalarKind* kind) {
  auto q = query.dimensions();
  auto kc = key_cache.dimensions();
  auto vc = value_cache.dimensions();
  auto bt = block_tables.dimensions();
  auto sl = seq_lens.dimensions();
  if (!ToScalarKind(query.element_type(), kind))
    return ArgError("query must be float32, float16 or bfloat16");
  CacheKind cache_kind = CacheKind::kSameAsQuery;
  if (key_cache.element_type() != query.element_type()) {
    if (!extended || !ToFp8Kind(key_cache.element_type(), &cache_kind))
      return ArgError(extended ? "key_cache must have the query's dtype or be float8_e4m3fn / "
                                 "float8_e5m2"
                               : "key_cache, value_cache and out must have the query's dtype");
  }
  if (value_cache.element_type() != key_cache.element_type())
    return ArgError("value_cache must have key_cache's dtype");
  if (out.element_type() != query.element_type())
    return ArgError("out must have the query's dtype");
  if (q.size() != 3 && !(extended && q.size() == 4))
    return ArgError(std::string("query must be ") + (extended ? "3-D or 4-D" : "3-D") +
                    ", got " + DimsToString(q));
  const int64_t x = 16 / CacheElemSize(*kind, cache_kind);
  if (kc.size() != 5) return ArgError("key_cache must be 5-D, got " + DimsToString(kc));
  if (vc.size() != 4) return ArgError("value_cache must be 4-D, got " + DimsToString(vc));
  const bool multi = q.size() == 4;
  const int64_t num_seqs = q[0], q_len = multi ? q[1] : 1;
  const int64_t num_heads = q[multi ? 2 : 1], head_size = q[multi ? 3 : 2];
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
  if (out.dimensions().size() != q.size() ||
      static_cast<int64_t>(out.element_count()) != num_seqs * q_len * num_heads * head_size)
    return ArgError("out must have the query's shape");
  if (head_size % 8 != 0 || head_size > kMaxHeadSize || head_size <= 0)
    return ArgError("head_size must be a multiple of 8 up to " + std::to_string(kMaxHeadSize) +
                    ", got " + std::to_string(head_size));
  if (block_size <= 0 || block_size > kMaxBlockSize)
    return ArgError("block_size must be in [1, " + std::to_string(kMaxBlockSize) + "], got " +
                    std::to_string(block_size));
  if (q_len <= 0 && num_seqs > 0)
    return ArgError("q_len (query.shape[1]) must be positive");
  if (!FitsInt(num_seqs)) return IntRangeError("num_seqs", num_seqs);
  if (!FitsInt(num_heads)) return IntRangeError("num_heads", num_heads);
  if (!FitsInt(bt[1])) return IntRangeError("max_blocks_per_seq", bt[1]);
  // Kernels index rows (sequence, position, head) and token positions as int.
  if (!FitsInt(num_seqs * q_len * num_heads))
    return IntRangeError("num_seqs * q_len * num_heads", num_seqs * q_len * num_heads);
  if (!FitsInt(bt[1] * block_size))
    return IntRangeError("max_blocks_per_seq * block_size", bt[1] * block_size);

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
  p->q_len = static_cast<int>(q_len);
  p->query_kind = *kind;
  p->cache_kind = cache_kind;
  return ffi::Error::Success();
}

// A dequantisation scale operand: float32 with 0 elements (none: scale 1),
// 1 element (per tensor) or num_kv_heads elements (per KV head). fp8 caches
// only.
inline ffi::Error UnpackScale(const char* name, ffi::AnyBuffer scale, int num_kv_heads,
                              bool fp8_cache, const float** ptr, int* stride) {
  const int64_t n = static_cast<int64_t>(scale.element_count());
  *ptr = nullptr;
  *stride = 0;
  if (n == 0) return ffi::Error::Success();
  if (!fp8_cache)
    return ArgError(std::string(name) + " applies to float8 caches only");
  if (scale.element_type() != ffi::DataType::F32 || (n != 1 && n != num_kv_heads))
    return ArgError(std::string(name) + " must be float32 with 1 or num_kv_heads (" +
                    std::to_string(num_kv_heads) + ") elements, got " +
                    DimsToString(scale.dimensions()));
  *ptr = reinterpret_cast<const float*>(scale.untyped_data());
  *stride = n == 1 ? 0 : 1;
  return ffi::Error::Success();
}

}  // namespace detail

// Unpacks and checks the paged-attention operands. `alibi` may have zero
// elements, meaning no ALiBi. (The seed's contract: 3-D query, caches of the
// query's dtype; the extension fields of `p` keep their defaults.)
inline ffi::Error UnpackPagedAttention(ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                                       ffi::AnyBuffer value_cache,
                                       ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                                       ffi::AnyBuffer alibi, ffi::AnyBuffer out,
                                       PagedAttentionParams* p, ScalarKind* kind) {
  return detail::UnpackAttentionCore(query, key_cache, value_cache, block_tables, seq_lens,
                                     alibi, out, /*extended=*/false, p, kind);
}

// The extended contract of the classic V1/V2 targets: everything
// UnpackPagedAttention accepts, plus 4-D multi-token queries
// [num_seqs, q_len, num_heads, head_size], fp8 caches (float8_e4m3fn /
// float8_e5m2, x = 16) with k_scale / v_scale operands (0 elements = 1),
// soft cap, sliding window, and an optional lse result (0 elements = not
// requested; else float32 with num_seqs * q_len * num_heads elements).
inline ffi::Error UnpackPagedAttentionExt(ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                                          ffi::AnyBuffer value_cache,
                                          ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                                          ffi::AnyBuffer alibi, ffi::AnyBuffer k_scale,
                                          ffi::AnyBuffer v_scale, float soft_cap,
                                          int64_t sliding_window, ffi::AnyBuffer out,
                                          ffi::AnyBuffer lse, PagedAttentionParams* p,
                                          ScalarKind* kind) {
  if (auto err = detail::UnpackAttentionCore(query, key_cache, value_cache, block_tables,
                                             seq_lens, alibi, out, /*extended=*/true, p, kind);
      err.failure())
    return err;
  const bool fp8 = p->cache_kind != CacheKind::kSameAsQuery;
  if (auto err = detail::UnpackScale("k_scale", k_scale, p->num_kv_heads, fp8, &p->k_scale,
                                     &p->k_scale_stride);
      err.failure())
    return err;
  if (auto err = detail::UnpackScale("v_scale", v_scale, p->num_kv_heads, fp8, &p->v_scale,
                                     &p->v_scale_stride);
      err.failure())
    return err;
  // 0 = off; else 1 / soft_cap must be a normal float too (the kernels multiply by it).
  if (!(soft_cap == 0.0f || (soft_cap >= FLT_MIN && soft_cap <= 1.0f / FLT_MIN)))
    return ArgError("soft_cap must be 0 (off) or in [2^-126, 2^126], got " +
                    std::to_string(soft_cap));
  if (sliding_window < 0 || sliding_window > INT32_MAX)
    return ArgError("sliding_window must be in [0, 2^31) (0 = off), got " +
                    std::to_string(sliding_window));
  p->soft_cap = soft_cap;
  p->sliding_window = static_cast<int>(sliding_window);
  const int64_t lse_n = static_cast<int64_t>(lse.element_count());
  if (lse_n != 0) {
    if (lse.element_type() != ffi::DataType::F32 ||
        lse_n != int64_t{p->num_seqs} * p->q_len * p->num_heads)
      return ArgError("lse must be float32 [num_seqs, (q_len,) num_heads], got " +
                      DimsToString(lse.dimensions()));
    p->lse = reinterpret_cast<float*>(lse.untyped_data());
  }
  return ffi::Error::Success();
}

// Checks the V2 workspace results and the partition size, fills p. The
// workspace has num_seqs * q_len * num_heads rows of max_num_partitions
// (q_len = 1 unless set by UnpackPagedAttentionExt).
inline ffi::Error UnpackPartitions(int64_t partition_size, ffi::AnyBuffer exp_sums,
                                   ffi::AnyBuffer max_logits, ffi::AnyBuffer tmp_out,
                                   PagedAttentionParams* p) {
  if (partition_size <= 0 || partition_size % p->block_size != 0 || !FitsInt(partition_size))
    return ArgError("partition_size must be a positive multiple of block_size (" +
                    std::to_string(p->block_size) + ") below 2^31, got " +
                    std::to_string(partition_size));
  const int64_t capacity = int64_t{p->max_blocks_per_seq} * p->block_size;
  const int64_t parts = std::max<int64_t>(1, (capacity + partition_size - 1) / partition_size);
  const int64_t rows = int64_t{p->num_seqs} * p->q_len * p->num_heads * parts;
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

// Unpacks the cache write. Caches of key's dtype (k_scale / v_scale empty),
// or fp8 caches with float32/float16/bfloat16 keys and optional scales
// (0, 1 or num_kv_heads float32 elements). `kind` is the key's dtype.
// The in-place cache ops lower with operand_output_aliases, so XLA normally
// hands the handler the same buffer as operand and result, and nothing needs
// copying. It does not always: on CUDA, while tracing a command buffer inside
// a loop, distinct buffers were seen. Then the result must first become a copy
// of the operand (or everything but the written slots would be lost); the
// handler does that on its own stream / thread before the kernel runs.
struct UnaliasedCaches {
  const void* src[2] = {nullptr, nullptr};
  void* dst[2] = {nullptr, nullptr};
  size_t bytes[2] = {0, 0};
  int count = 0;
};

inline UnaliasedCaches FindUnaliasedCaches(ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                           ffi::Result<ffi::AnyBuffer> key_cache_out,
                                           ffi::Result<ffi::AnyBuffer> value_cache_out) {
  UnaliasedCaches c;
  const ffi::AnyBuffer* in[2] = {&key_cache, &value_cache};
  ffi::AnyBuffer* out[2] = {&*key_cache_out, &*value_cache_out};
  for (int i = 0; i < 2; ++i) {
    if (in[i]->untyped_data() == out[i]->untyped_data() || in[i]->size_bytes() == 0) continue;
    c.src[c.count] = in[i]->untyped_data();
    c.dst[c.count] = out[i]->untyped_data();
    c.bytes[c.count] = in[i]->size_bytes();
    ++c.count;
  }
  return c;
}

inline ffi::Error UnpackReshapeAndCache(ffi::AnyBuffer key, ffi::AnyBuffer value,
                                        ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                        ffi::AnyBuffer slot_mapping, ffi::AnyBuffer k_scale,
                                        ffi::AnyBuffer v_scale,
                                        ffi::Result<ffi::AnyBuffer> key_cache_out,
                                        ffi::Result<ffi::AnyBuffer> value_cache_out,
                                        ReshapeAndCacheParams* p, ScalarKind* kind) {
  auto k = key.dimensions();
  auto kc = key_cache.dimensions();
  auto vc = value_cache.dimensions();
  if (!ToScalarKind(key.element_type(), kind))
    return ArgError("key must be float32, float16 or bfloat16");
  CacheKind cache_kind = CacheKind::kSameAsQuery;
  if (key_cache.element_type() != key.element_type() &&
      !ToFp8Kind(key_cache.element_type(), &cache_kind))
    return ArgError("key_cache must have key's dtype or be float8_e4m3fn / float8_e5m2");
  if (value.element_type() != key.element_type() ||
      value_cache.element_type() != key_cache.element_type())
    return ArgError("value must have key's dtype and value_cache key_cache's dtype");
  if (k.size() != 3 || value.dimensions().size() != 3 ||
      key.element_count() != value.element_count())
    return ArgError("key and value must be [num_tokens, num_kv_heads, head_size], got " +
                    DimsToString(k) + " and " + DimsToString(value.dimensions()));
  const int64_t x = 16 / CacheElemSize(*kind, cache_kind);
  if (kc.size() != 5 || vc.size() != 4 || kc[1] != k[1] || kc[2] * x != k[2] || kc[4] != x ||
      vc[0] != kc[0] || vc[1] != k[1] || vc[2] != k[2] || vc[3] != kc[3])
    return ArgError("caches " + DimsToString(kc) + " / " + DimsToString(vc) +
                    " do not match key " + DimsToString(k));
  if (slot_mapping.element_type() != ffi::DataType::S32 ||
      static_cast<int64_t>(slot_mapping.element_count()) != k[0])
    return ArgError("slot_mapping must be int32 [num_tokens]");
  if (!FitsInt(k[0])) return IntRangeError("num_tokens", k[0]);
  if (k[1] <= 0 || !FitsInt(k[1])) return IntRangeError("num_kv_heads", k[1]);
  if (k[2] <= 0 || k[2] > kMaxHeadSize)
    return ArgError("head_size must be in [1, " + std::to_string(kMaxHeadSize) + "], got " +
                    std::to_string(k[2]));
  if (kc[3] <= 0 || kc[3] > kMaxBlockSize)
    return ArgError("block_size must be in [1, " + std::to_string(kMaxBlockSize) + "], got " +
                    std::to_string(kc[3]));
  const bool fp8 = cache_kind != CacheKind::kSameAsQuery;
  if (auto err = detail::UnpackScale("k_scale", k_scale, static_cast<int>(k[1]), fp8,
                                     &p->k_scale, &p->k_scale_stride);
      err.failure())
    return err;
  if (auto err = detail::UnpackScale("v_scale", v_scale, static_cast<int>(k[1]), fp8,
                                     &p->v_scale, &p->v_scale_stride);
      err.failure())
    return err;
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
  p->key_kind = *kind;
  p->cache_kind = cache_kind;
  return ffi::Error::Success();
}

inline ffi::Error UnpackCopyBlocks(ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                   ffi::AnyBuffer block_mapping,
                                   ffi::Result<ffi::AnyBuffer> key_cache_out,
                                   ffi::Result<ffi::AnyBuffer> value_cache_out,
                                   CopyBlocksParams* p, int* elem_size) {
  auto kc = key_cache.dimensions();
  auto bm = block_mapping.dimensions();
  ScalarKind kind;
  CacheKind fp8;
  if (ToScalarKind(key_cache.element_type(), &kind)) {
    *elem_size = ElemSize(kind);
  } else if (ToFp8Kind(key_cache.element_type(), &fp8)) {
    *elem_size = 1;
  } else {
    return ArgError("caches must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2");
  }
  if (value_cache.element_type() != key_cache.element_type())
    return ArgError("caches must share a dtype");
  if (kc.size() != 5 || key_cache.element_count() != value_cache.element_count())
    return ArgError("key_cache and value_cache disagree");
  if (block_mapping.element_type() != ffi::DataType::S32 || bm.size() != 2 || bm[1] != 2)
    return ArgError("block_mapping must be int32 [num_pairs, 2], got " + DimsToString(bm));
  if (!FitsInt(bm[0])) return IntRangeError("num_pairs", bm[0]);
  p->key_cache = key_cache_out->untyped_data();
  p->value_cache = value_cache_out->untyped_data();
  p->block_mapping = reinterpret_cast<const int32_t*>(block_mapping.untyped_data());
  p->num_pairs = static_cast<int>(bm[0]);
  p->num_blocks = kc[0];
  p->block_elems = kc[0] == 0 ? 0 : static_cast<int64_t>(key_cache.element_count()) / kc[0];
  return ffi::Error::Success();
}

// The operands and attributes the V1, V2 (and CPU / CUDA) attention handlers
// share, appended to `binding` (ffi::Ffi::Bind(), plus the stream context on
// CUDA); V1 then adds its results, V2 its partition size and results.
template <typename Binding>
auto BindAttentionOperands(Binding binding) {
  // Binding's builder methods are rvalue-qualified.
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()            // query
      .template Arg<ffi::AnyBuffer>()            // key_cache
      .template Arg<ffi::AnyBuffer>()            // value_cache
      .template Arg<ffi::AnyBuffer>()            // block_tables
      .template Arg<ffi::AnyBuffer>()            // seq_lens
      .template Arg<ffi::AnyBuffer>()            // alibi_slopes
      .template Arg<ffi::AnyBuffer>()            // k_scale
      .template Arg<ffi::AnyBuffer>()            // v_scale
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int64_t>("sliding_window");
}

}  // namespace jax_paged
