// Handler symbols exported by the FFI layer, one set per platform. The
// Python side registers them under the same target names on "cpu" and "CUDA".
//
// Call signatures (operands, attributes -> results):
//   paged_attention_v1: query, key_cache, value_cache, block_tables, seq_lens,
//                       alibi_slopes ([num_heads] f32, or [0] for none);
//                       scale: f32  -> out
//   paged_attention_v2: same operands; scale: f32, partition_size: i64
//                       -> out, exp_sums, max_logits, tmp_out (workspace)
//   reshape_and_cache:  key, value, key_cache, value_cache, slot_mapping
//                       -> key_cache, value_cache   (aliased, in place)
//   copy_blocks:        key_cache, value_cache, block_mapping
//                       -> key_cache, value_cache   (aliased, in place)
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxPagedAttentionV1Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxPagedAttentionV2Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxPagedReshapeAndCacheCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxPagedCopyBlocksCpu);

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxPagedAttentionV1Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxPagedAttentionV2Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxPagedReshapeAndCacheCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxPagedCopyBlocksCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxPagedAttentionGroupedCuda);
