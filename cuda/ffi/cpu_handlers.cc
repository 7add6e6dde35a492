// XLA FFI handlers for the CPU kernels: unpack + check (common.h), dispatch on
// the element type, run.
#include "../cpu/paged_attention_cpu.h"
#include "common.h"
#include "handlers.h"

namespace jax_paged {
namespace {

using cpu::CpuScalar;

ffi::Error PagedAttentionV1Cpu(ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                               ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                               ffi::AnyBuffer seq_lens, ffi::AnyBuffer alibi, float scale,
                               ffi::Result<ffi::AnyBuffer> out) {
  PagedAttentionParams p;
  ScalarKind kind;
  if (auto err = UnpackPagedAttention(query, key_cache, value_cache, block_tables, seq_lens,
                                      alibi, *out, &p, &kind);
      err.failure())
    return err;
  p.scale = scale;
  return DispatchScalar(kind, [&](auto tag) {
    cpu::PagedAttentionV1<typename CpuScalar<decltype(tag)::value>::type>(p);
    return ffi::Error::Success();
  });
}

ffi::Error PagedAttentionV2Cpu(ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                               ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                               ffi::AnyBuffer seq_lens, ffi::AnyBuffer alibi, float scale,
                               int64_t partition_size, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> exp_sums,
                               ffi::Result<ffi::AnyBuffer> max_logits,
                               ffi::Result<ffi::AnyBuffer> tmp_out) {
  PagedAttentionParams p;
  ScalarKind kind;
  if (auto err = UnpackPagedAttention(query, key_cache, value_cache, block_tables, seq_lens,
                                      alibi, *out, &p, &kind);
      err.failure())
    return err;
  if (auto err = UnpackPartitions(partition_size, *exp_sums, *max_logits, *tmp_out, &p);
      err.failure())
    return err;
  p.scale = scale;
  return DispatchScalar(kind, [&](auto tag) {
    cpu::PagedAttentionV2<typename CpuScalar<decltype(tag)::value>::type>(p);
    return ffi::Error::Success();
  });
}

ffi::Error ReshapeAndCacheCpu(ffi::AnyBuffer key, ffi::AnyBuffer value, ffi::AnyBuffer key_cache,
                              ffi::AnyBuffer value_cache, ffi::AnyBuffer slot_mapping,
                              ffi::Result<ffi::AnyBuffer> key_cache_out,
                              ffi::Result<ffi::AnyBuffer> value_cache_out) {
  ReshapeAndCacheParams p;
  ScalarKind kind;
  if (auto err = UnpackReshapeAndCache(key, value, key_cache, value_cache, slot_mapping,
                                       key_cache_out, value_cache_out, &p, &kind);
      err.failure())
    return err;
  return DispatchScalar(kind, [&](auto tag) {
    cpu::ReshapeAndCache<typename CpuScalar<decltype(tag)::value>::type>(p);
    return ffi::Error::Success();
  });
}

ffi::Error CopyBlocksCpu(ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                         ffi::AnyBuffer block_mapping, ffi::Result<ffi::AnyBuffer> key_cache_out,
                         ffi::Result<ffi::AnyBuffer> value_cache_out) {
  CopyBlocksParams p;
  ScalarKind kind;
  if (auto err = UnpackCopyBlocks(key_cache, value_cache, block_mapping, key_cache_out,
                                  value_cache_out, &p, &kind);
      err.failure())
    return err;
  cpu::CopyBlocks(p, ElemSize(kind));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_paged

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedAttentionV1Cpu, jax_paged::PagedAttentionV1Cpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // query
                                  .Arg<ffi::AnyBuffer>()  // key_cache
                                  .Arg<ffi::AnyBuffer>()  // value_cache
                                  .Arg<ffi::AnyBuffer>()  // block_tables
                                  .Arg<ffi::AnyBuffer>()  // seq_lens
                                  .Arg<ffi::AnyBuffer>()  // alibi_slopes
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedAttentionV2Cpu, jax_paged::PagedAttentionV2Cpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("partition_size")
                                  .Ret<ffi::AnyBuffer>()   // out
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
                                  .Ret<ffi::AnyBuffer>()   // key_cache (aliased)
                                  .Ret<ffi::AnyBuffer>());  // value_cache (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxPagedCopyBlocksCpu, jax_paged::CopyBlocksCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // key_cache
                                  .Arg<ffi::AnyBuffer>()  // value_cache
                                  .Arg<ffi::AnyBuffer>()  // block_mapping
                                  .Ret<ffi::AnyBuffer>()   // key_cache (aliased)
                                  .Ret<ffi::AnyBuffer>());  // value_cache (aliased)
