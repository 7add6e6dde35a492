// Handler symbols exported by the FFI layer, one set per platform. The
// Python side registers them under the same target names on "cpu" and "CUDA".
//
// Call signatures (operands, attributes -> results):
//   paged_attention_v1: query ([S, H, D] or [S, q_len, H, D]), key_cache,
//                       value_cache (query dtype, or fp8), block_tables,
//                       seq_lens, alibi_slopes ([num_heads] f32, or [0] for
//                       none), k_scale, v_scale ([1] / [num_kv_heads] f32, or
//                       [0] for none); scale: f32, soft_cap: f32 (0 = off),
//                       sliding_window: i64 (0 = off)
//                       -> out, lse ([S, (q_len,) H] f32, or [0] = not wanted)
//   paged_attention_v2: same operands and attributes, plus partition_size: i64
//                       -> out, lse, exp_sums, max_logits, tmp_out (workspace)
//   paged_attention_grouped (CUDA only): paged_attention_v2's contract, the
//                       split-KV GQA-grouped kernel (fp8 caches only with
//                       float16 / bfloat16 queries)
//   reshape_and_cache:  key, value, key_cache, value_cache, slot_mapping,
//                       k_scale, v_scale ([0] = none; fp8 caches only)
//                       -> key_cache, value_cache   (aliased, in place)
//   copy_blocks:        key_cache, value_cache, block_mapping
//                       -> key_cache, value_cache   (aliased, in place)
#pragma once

#include <cstdint>

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

// CUDA only: CTAs resident per SM (0 if unsupported) and query rows per CTA of
// the grouped kernel a call runs, for a query / cache element size (bytes; 1 =
// fp8), head size, query rows per KV head (q_len * group), query length and
// (sequence, KV head) pairs (num_seqs * num_kv_heads). The Python partition rule
// sizes its split with them.
int JaxPagedGroupedCtasPerSm(int query_itemsize, int cache_itemsize, int head_size,
                             int rows_per_kv_head, int q_len, int64_t seq_kv_heads);
int JaxPagedGroupedRowsPerCta(int query_itemsize, int cache_itemsize, int head_size,
                              int rows_per_kv_head, int q_len, int64_t seq_kv_heads);
// CUDA only: the development build options (CMakeLists.txt, "(development)") the
// kernels were built with, space-separated without the JAX_PAGED_ prefix; "" for
// a default build.
const char* JaxPagedDevelopmentOptions();

#ifdef JAX_PAGED_TRACE
// Development builds only: device buffer of [capacity_ctas][8] uint64 that
// every later grouped launch fills with per-CTA timestamps (0 = off).
void JaxPagedSetGroupedTrace(uintptr_t buffer, int capacity_ctas);
#endif
