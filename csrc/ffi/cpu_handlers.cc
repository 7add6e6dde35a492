// XLA FFI handlers for the CPU kernels: unpack + check (common.h), dispatch on
// the element type, run.
#include <cstring>

#include "cpu/paged_attention_cpu.h"
#include "ffi/common.h"
#include "ffi/handlers.h"

namespace jax_paged {
namespace {

// See UnaliasedCaches (common.h): normally a no-op.
void CopyUnaliasedCaches(const UnaliasedCaches& c) {
  for (int i = 0; i < c.count; ++i) std::memcpy(c.dst[i], c.src[i], c.bytes[i]);
}

using cpu::CpuCache;
using cpu::CpuScalar;

// Calls f(T{}, TC{}) with T the query's CPU storage type and TC the cache's.
template <typename F>
ffi::Error DispatchAttentionTypes(ScalarKind query_kind, CacheKind cache_kind, F&& f) {
  return DispatchScalar(query_kind, [&](auto qtag) {
    using T = typename CpuScalar<decltype(qtag)::value>::type;
    if (cache_kind == CacheKind::kSameAsQuery) return f(T{}, T{});
    return DispatchFp8(cache_kind, [&](auto ctag) {
      using TC = typename CpuCache<decltype(ctag)::value, T>::type;
      return f(T{}, TC{});
    });
  });
}

ffi::Error PagedAttentionV1Cpu(ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                               ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                               ffi::AnyBuffer seq_lens, ffi::AnyBuffer alibi,
                               ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, float scale,
                               float soft_cap, int64_t sliding_window,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> lse) {
  PagedAttentionParams p;
  ScalarKind kind;
  if (auto err = UnpackPagedAttentionExt(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi, k_scale, v_scale, soft_cap, sliding_window, *out,
                                         *lse, &p, &kind);
      err.failure())
    return err;
  p.scale = scale;
  return DispatchAttentionTypes(kind, p.cache_kind, [&](auto t, auto tc) {
    cpu::PagedAttentionV1<decltype(t), decltype(tc)>(p);
    return ffi::Error::Success();
  });
}

ffi::Error PagedAttentionV2Cpu(ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                               ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                               ffi::AnyBuffer seq_lens, ffi::AnyBuffer alibi,
                               ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, float scale,
                               float soft_cap, int64_t sliding_window, int64_t partition_size,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                               ffi::Result<ffi::AnyBuffer> exp_sums,
                               ffi::Result<ffi::AnyBuffer> max_logits,
                               ffi::Result<ffi::AnyBuffer> tmp_out) {
  PagedAttentionParams p;
  ScalarKind kind;
  if (auto err = UnpackPagedAttentionExt(query, key_cache, value_cache, block_tables, seq_lens,
                                         alibi, k_scale, v_scale, soft_cap, sliding_window, *out,
                                         *lse, &p, &kind);
      err.failure())
    return err;
  if (auto err = UnpackPartitions(partition_size, *exp_sums, *max_logits, *tmp_out, &p);
      err.failure())
    return err;
  p.scale = scale;
  return DispatchAttentionTypes(kind, p.cache_kind, [&](auto t, auto tc) {
    cpu::PagedAttentionV2<decltype(t), decltype(tc)>(p);
    return ffi::Error::Success();
  });
}

ffi::Error ReshapeAndCacheCpu(ffi::AnyBuffer key, ffi::AnyBuffer value, ffi::AnyBuffer key_cache,
                              ffi::AnyBuffer value_cache, ffi::AnyBuffer slot_mapping,
                              ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                              ffi::Result<ffi::AnyBuffer> key_cache_out,
                              ffi::Result<ffi::AnyBuffer> value_cache_out) {
  ReshapeAndCacheParams p;
  ScalarKind kind;
  if (auto err = UnpackReshapeAndCache(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                       v_scale, key_cache_out, value_cache_out, &p, &kind);
      err.failure())
    return err;
  CopyUnaliasedCaches(FindUnaliasedCaches(key_cache, value_cache, key_cache_out, value_cache_out));
  return DispatchAttentionTypes(kind, p.cache_kind, [&](auto t, auto tc) {
    cpu::ReshapeAndCache<decltype(t), decltype(tc)>(p);
    return ffi::Error::Success();
  });
}

ffi::Error CopyBlocksCpu(ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                         ffi::AnyBuffer block_mapping, ffi::Result<ffi::AnyBuffer> key_cache_out,
                         ffi::Result<ffi::AnyBuffer> value_cache_out) {
  CopyBlocksParams p;
  int elem_size = 0;
  if (auto err = UnpackCopyBlocks(key_cache, value_cache, block_mapping, key_cache_out,
                                  value_cache_out, &p, &elem_size);
      err.failure())
    return err;
  CopyUnaliasedCaches(FindUnaliasedCaches(key_cache, value_cache, key_cache_out, value_cache_out));
  cpu::CopyBlocks(p, elem_size);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_paged

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedAttentionV1Cpu, jax_paged::PagedAttentionV1Cpu,
                              jax_paged::BindAttentionOperands(ffi::Ffi::Bind())
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedAttentionV2Cpu, jax_paged::PagedAttentionV2Cpu,
                              jax_paged::BindAttentionOperands(ffi::Ffi::Bind())
                                  .Attr<int64_t>("partition_size")
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>()   // lse
                                  .Ret<ffi::AnyBuffer>()   // exp_sums
                                  .Ret<ffi::AnyBuffer>()   // max_logits
                                  .Ret<ffi::AnyBuffer>());  // tmp_out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedReshapeAndCacheCpu, jax_paged::ReshapeAndCacheCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Arg<ffi::AnyBuffer>()  // value
                                  .Arg<ffi::AnyBuffer>()  // key_cache
                                  .Arg<ffi::AnyBuffer>()  // value_cache
                                  .Arg<ffi::AnyBuffer>()  // slot_mapping
                                  .Arg<ffi::AnyBuffer>()  // k_scale
                                  .Arg<ffi::AnyBuffer>()  // v_scale
                                  .Ret<ffi::AnyBuffer>()   // key_cache (aliased)
                                  .Ret<ffi::AnyBuffer>());  // value_cache (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedCopyBlocksCpu, jax_paged::CopyBlocksCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // key_cache
                                  .Arg<ffi::AnyBuffer>()  // value_cache
                                  .Arg<ffi::AnyBuffer>()  // block_mapping
                                  .Ret<ffi::AnyBuffer>()   // key_cache (aliased)
                                  .Ret<ffi::AnyBuffer>());  // value_cache (aliased)
