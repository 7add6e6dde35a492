// Host-visible part of the split-KV, GQA-grouped decode kernel
// (impl="grouped"): its compile-time configuration (tile, pipeline depth,
// shared-memory layout) and the launcher declaration. Framework-free; the
// kernel itself is in grouped_attention.cuh, instantiated per dtype in
// instances/grouped_<dtype>.cu.
//
// Contract: exactly paged_attention_v2's (params.h, paged_attention.cuh),
// extensions included (fp8 caches with 16-bit queries, scales, soft cap,
// sliding window, LSE, multi-token queries): grid (num_kv_heads *
// group_chunks, num_seqs, max_num_partitions), one CTA per (KV head,
// sequence, partition) computing ALL query rows of its KV head (q_len *
// group of them, up to GroupedConfig::kRows per CTA; more are split into group_chunks),
// so each K/V page is read from HBM once per partition instead of once per
// query row.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/launch.h"
#include "cuda/options.h"
#include "params.h"

namespace jax_paged {
namespace cuda {
namespace grouped {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRows = 16;   // query heads per CTA: the M of mma.m16n8k16
constexpr int kMinBlockSize = 8;
constexpr int kMaxBlockSize = 32;

// The row split at head sizes above 128 (the "wide" row split): 64-row CTAs, each
// warp all the dims of its 16 rows, 32-token tiles, the query rows read from shared
// memory per product, instead of 16-row CTAs that each read the KV head's pages.
// fp8 caches take it too (32-token tiles of 16 KB at head 256).
constexpr bool WideRowSplitHead(int d) { return d > 128; }
// 32-row CTAs (two row blocks) exist at head sizes up to 128, for 16-bit and fp8
// caches alike; the wide row split has 64-row CTAs only.
constexpr bool TwoRowBlocksAvailable(int d) { return !WideRowSplitHead(d); }

// Whether a kernel's CTAs per SM vary per call (GroupedConfig's kFp8Ctas, chosen by
// WithGroupedLayout): the fp8 decode kernels with 16 KB stages, i.e. fp8 caches under
// a 16-bit query, 16-row CTAs, head sizes up to 128.
constexpr bool Fp8CtasVaried(int qelem, int celem, int d, int row_blocks) {
  return qelem == 2 && celem == 1 && row_blocks == 1 && !WideRowSplitHead(d);
}

constexpr int ClampInt(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }
constexpr int RoundUp(int v, int m) { return (v + m - 1) / m * m; }
constexpr int Log2(int v) { return v > 1 ? 1 + Log2(v / 2) : 0; }  // of a power of two

// QELEM: bytes of one query element (2 for f16/bf16 -> tensor cores, 4 for
// f32 -> CUDA cores). CELEM: bytes of one cache element (QELEM, or 1 for fp8
// caches, which need QELEM == 2: they are widened to f16 in registers,
// exactly, for the f16 tensor cores). D: head size.
// kRowBlocks (1, 2 or 4; more than 1 only for 16-bit queries: 2 or 4 at
// D <= 128, 4 at D 192 / 256, see RowBlocks): blocks of 16 query rows per CTA.
// With kRowBlocks > 1 the warps split over rows as well as tokens: warp w owns
// row block w / kSliceGroups and computes every kSliceGroups-th token slice of
// each tile from slice w % kSliceGroups (in one pass), so that a KV head with more than 16 rows
// (q_len * group > 16) reads each page once per 16 * kRowBlocks rows instead of
// once per 16 (see SelectGroupedKernel). kRowBlocks == 1 is the decode kernel.
// kWarpgroups (1, or 2 for the wgmma form's 128-row CTAs): warpgroups of 4 warps
// per CTA, each computing kRowBlocks * 16 rows over the same stages, so that each
// page is copied once per 128 rows instead of once per 64 (one CTA per SM).
// kFp8Ctas: 0, or 2 for the fp8 decode kernels with 16 KB stages (head sizes up
// to 128, Fp8CtasVaried), which then run two CTAs per SM with six stages instead of four with
// three, the same ~200 KB of stages per SM: at B=1 half the partitions and
// per-CTA fixed costs; at head 64, 64 x 8 items in two waves instead of one.
// Which of the two a call runs is Fp8CtasFor's rule (few work items: two).
template <int QELEM, int CELEM, int D, int kRowBlocks = 1, int kWarpgroups = 1, int kFp8Ctas = 0>
struct GroupedConfig {
  static constexpr bool kMma = QELEM == 2;
  static constexpr bool kFp8 = CELEM == 1;
  static_assert(CELEM == QELEM || (kFp8 && kMma), "fp8 caches need a 16-bit query");
  static_assert(!kFp8 || D % 16 == 0, "fp8 caches need head_size % 16 == 0");
  static constexpr int kQX = 16 / QELEM;  // query elements per 16-byte chunk
  static constexpr bool kRowSplit = kRowBlocks > 1;
  static_assert(kFp8Ctas == 0 || (kFp8Ctas == 2 && Fp8CtasVaried(QELEM, CELEM, D, kRowBlocks)),
                "kFp8Ctas: two CTAs per SM, fp8 decode kernels with 16 KB stages only");
  // Each warp owns a 16-token slice of a tile; for large heads with 16-bit
  // caches two warps share a slice (both compute its 16x16 logits, each does
  // half of P.V), so that the tile, the accumulators and the registers stay
  // small. fp8 caches keep one warp per slice (D = 256: 64-token stages of
  // 32 KB at two CTAs per SM, like 16-bit D = 128; ~190 registers, no
  // spills), since duplicating the logits' widening and mma cost them more.
  // (The row split, kRowBlocks > 1, keeps one warp per slice: each warp all the dims
  // of its own 16 rows.)
  static constexpr int kWarpsPerSlice = D >= 192 && !kFp8 && kRowBlocks == 1 ? 2 : 1;
  static constexpr int kSlices = kWarps / kWarpsPerSlice;
  // 16-token sub-slices per warp slice: 2 for fp8 caches at head sizes <= 64
  // (a 32-token slice: its max shuffles, exponent of the rescale factor, O
  // rescale and loop overhead once per 32 tokens; that per-slice work weighs
  // twice as much per byte at head 64 as at 128), else 1. (The fp8 row split:
  // its four 16-token slices per pass instead.)
  static constexpr int kSubSlices = kFp8 && D <= 64 && !kRowSplit ? 2 : 1;
  // The wide row split (head sizes above 128, 64 rows): each warp walks 2 slices
  // per tile, not 4, so that a stage stays at 32 KB (32 tokens) at head 256.
  static constexpr bool kWide = kRowBlocks > 1 && WideRowSplitHead(D);
  static constexpr int kTile = 16 * kSlices * kSubSlices / (kWide ? 2 : 1);  // tokens per stage (32..128)
  static constexpr int kDimsPerWarp = D / kWarpsPerSlice;
  static constexpr int kNTiles = kDimsPerWarp / 8;  // P.V n-tiles (8 dims) per warp
  static_assert(D % 8 == 0 && kDimsPerWarp % 8 == 0, "head size must be a multiple of 8");
  static_assert(kTile % kMaxBlockSize == 0, "a tile must hold whole pages");
  static constexpr int kTileElems = kTile * D;  // elements of K (or of V) in one stage
  static constexpr int kStageBytes = 2 * kTileElems * CELEM;
  static_assert(kRowBlocks == 1 || kRowBlocks == 2 || kRowBlocks == 4, "1, 2 or 4 row blocks");
  static_assert(kRowBlocks == 1 || (kMma && kWarpsPerSlice == 1), "the row split: 16-bit queries");
  static_assert(kRowBlocks != 2 || TwoRowBlocksAvailable(D), "no 32-row CTAs here");
  // Query rows per CTA; warps per row block (each computing its own token slices);
  // token slices each warp computes per tile (one pass); slice partials the epilogue merges
  // per row (one per warp of a row block).
  static_assert(kWarpgroups == 1 || (kWarpgroups == 2 && kRowBlocks == 4 && kMma && !kFp8 &&
                                      !kWide),
                "two warpgroups: the 16-bit wgmma form's 64-row blocks");
  static constexpr int kCtaThreads = kThreads * kWarpgroups;  // threads per CTA
  static constexpr int kRows = kRowBlocks * kMaxRows * kWarpgroups;
  static constexpr int kSliceGroups = kSlices / kRowBlocks;
  static constexpr int kSlicesPerWarp = kWide ? kRowBlocks / 2 : kRowBlocks;
  static_assert(!kRowSplit || kTile == 16 * kSliceGroups * kSlicesPerWarp, "row split: a tile");
  // The row split holds its warp's 16 query rows in registers (D / 16 A fragments),
  // except the wide one, whose O fragments (D / 2 floats per lane) leave no room:
  // it reads them from shared memory per product, as the decode kernels do.
  static constexpr bool kQInRegs = kRowSplit && !kWide;
  static constexpr int kMergeSlices = kSliceGroups;
  // Query rows in shared memory, padded so that ldmatrix rows (16-bit path)
  // or float4 rows (f32 path) fall in different banks. The row split reads them
  // once, into registers, so its rows are not padded (its shared memory is short).
  static constexpr int kQStride =
      kQInRegs ? D : (kMma ? D + ((D / 8) % 2 == 0 ? 8 : 16) : D + 4);  // elements
  static constexpr int kQBytes = RoundUp(kRows * kQStride * QELEM, 16);
  // The row split reads its query rows once (into registers) before the last
  // stage's first copy is issued, so they are staged in that stage, not in a
  // buffer of their own: at two or four CTAs per SM that leaves room for one more
  // stage at some head sizes (D = 64 with 64 rows: 3 stages instead of 2; D = 112:
  // 4 instead of 3).
  // (The wgmma form and the fp8 64-row row split at two CTAs per SM load them
  // straight into registers and stage nothing: the kernel's kRegIO.)
  static constexpr bool kQInStage = kQInRegs;
  static constexpr int kQOwnBytes = kQInStage ? 0 : kQBytes;  // the buffer of its own
  static constexpr int kMlBytes = kMergeSlices * kRows * 2 * 4;
  // Target of CTAs resident per SM on Hopper (228 KB of shared memory): four
  // when a stage is at most 16 KB (head size 64 at 16 bits, fp8 caches up to
  // head size 128), with ~48 KB of stages each; otherwise two, with ~100 KB
  // each (f32 queries at large head sizes fit only one); kFp8Ctas overrides the
  // four. Small stages leave a CTA little compute per byte, so more warps per SM hide
  // its latencies. Either way 2..6 stages, ~200 KB in flight per SM.
  // The row split's stages fill what its CTAs-per-SM target leaves beside its
  // larger query buffer (1 KB per CTA reserved, 512 bytes of masks, barriers,
  // release counters and table entries):
  // three 32 KB stages at two CTAs per SM for D = 128 even with 64 rows.
  // (The fp8 row split above head size 64 holds the 16-bit one's registers, ~220 per
  // thread, in stages of 16 KB: two CTAs per SM.)
  // (Two warpgroups: one CTA per SM, the stages of two.)
  static constexpr int kTargetCtasPerSm =
      kWarpgroups == 2
          ? 1
          : (kStageBytes <= 16 * 1024 && !(kFp8 && kRowSplit && D > 64)
                 ? (kFp8Ctas ? kFp8Ctas : 4)
                 : 2);
  static constexpr int kStageBudget =
      kRowSplit ? 228 * 1024 / kTargetCtasPerSm - 1024 - kQOwnBytes - kMlBytes - 512
                : (kTargetCtasPerSm == 4 ? 48 : 100) * 1024;
  static constexpr int kStages = ClampInt(kStageBudget / kStageBytes, 2, 6);
  static constexpr int kQOff = (kQInStage ? kStages - 1 : kStages) * kStageBytes;
  static_assert(!kQInStage || kQBytes <= kStageBytes, "query rows in a stage");
  static constexpr int kMlOff = kStages * kStageBytes + kQOwnBytes;  // [kMergeSlices][kRows][2] float (max, sum)
  static constexpr int kMaskOff = kMlOff + kMlBytes;  // [kStages] uint32 page-valid bits
  // [kStages] mbarriers "stage full" (the bulk copies' bytes arrived); then
  // [kStages] uint32 release counters (warps done reading the stage: the warp
  // that makes it kWarps refills the stage); then [kStages][kMaxTilePages] int32,
  // the block-table entries of each stage's next refill.
  static constexpr int kMaxTilePages = kTile / kMinBlockSize;
  static constexpr int kBarOff = RoundUp(kMaskOff + kStages * 4, 8);
  static constexpr int kCountOff = kBarOff + kStages * 8;
  static constexpr int kTableOff = kCountOff + kStages * 4;
  static constexpr int kSmemBytes = kTableOff + kStages * kMaxTilePages * 4;
  // The final cross-slice combine reuses the stage buffers:
  // [kMergeSlices][kRows][kObufStride] float. Rows of D floats would put the
  // eight rows of a warp's float2 stores in the same banks when D % 32 == 0
  // (an 8-way conflict); D + 8 spreads them over all 32 banks.
  static constexpr int kObufStride = D + 8;
  static constexpr int kObufBytes = kMergeSlices * kRows * kObufStride * 4;
  // Each row's max, sum and output factor ([kRows][4] float) after the combine
  // buffer: in the query's buffer (no longer read by then), which the wide row
  // split's combine buffer runs into.
  static constexpr int kRowStatsOff = RoundUp(kObufBytes > kQOff ? kObufBytes : kQOff, 16);
  static_assert(kObufBytes <= kMlOff && kRowStatsOff + kRows * 16 <= kMlOff,
                "combine buffer and row stats (before the merge's max / sum)");
  // Resident CTAs per SM (1 KB of shared memory reserved per CTA): the
  // kernel's minimum-blocks bound, and what the Python partition rule
  // sizes its split with (grouped_ctas_per_sm).
  static constexpr int kCtasPerSm =
      ClampInt(228 * 1024 / (kSmemBytes + 1024), 1, kTargetCtasPerSm);
  static_assert(!kRowSplit || kCtasPerSm == kTargetCtasPerSm, "row split: stage budget");
};

// The stage counts and CTAs per SM the shared-memory budget above gives, which the
// measured configurations rest on: a change of the budget that drops a stage fails here.
static_assert(GroupedConfig<2, 2, 64, 4>::kStages == 3 && GroupedConfig<2, 2, 64, 4>::kCtasPerSm == 4,
              "row split: query rows in the last stage");
static_assert(GroupedConfig<2, 2, 112, 4>::kStages == 4 &&
                  GroupedConfig<2, 2, 128, 4>::kStages == 3 && GroupedConfig<2, 2, 128, 4>::kCtasPerSm == 2,
              "row split: query rows in the last stage");
static_assert(GroupedConfig<2, 2, 128>::kStages == 3 && GroupedConfig<2, 2, 128>::kCtasPerSm == 2 &&
                  GroupedConfig<2, 2, 64>::kCtasPerSm == 4 &&
                  GroupedConfig<2, 1, 128>::kCtasPerSm == 4 && GroupedConfig<2, 1, 128>::kStages == 3 &&
                  GroupedConfig<2, 1, 64>::kCtasPerSm == 4,
              "decode kernels: stages and CTAs per SM");
static_assert(GroupedConfig<2, 1, 128, 1, 1, 2>::kCtasPerSm == 2 &&
                  GroupedConfig<2, 1, 128, 1, 1, 2>::kStages == 6 &&
                  GroupedConfig<2, 1, 64, 1, 1, 2>::kCtasPerSm == 2,
              "fp8 decode variants (kFp8Ctas): ~200 KB of stages per SM");
static_assert(GroupedConfig<2, 2, 256, 4>::kTile == 32 && GroupedConfig<2, 2, 256, 4>::kStages == 2 &&
                  GroupedConfig<2, 2, 256, 4>::kCtasPerSm == 2 && GroupedConfig<2, 2, 192, 4>::kStages == 3,
              "the wide row split: 32-token tiles, two CTAs per SM");
static_assert(GroupedConfig<2, 1, 128, 4>::kStages == 6 && GroupedConfig<2, 1, 128, 4>::kCtasPerSm == 2 &&
                  GroupedConfig<2, 1, 64, 4>::kStages == 6 && GroupedConfig<2, 1, 64, 4>::kCtasPerSm == 4,
              "the fp8 row split: six stages");
static_assert(GroupedConfig<2, 2, 128, 4, 2>::kStages == 6 &&
                  GroupedConfig<2, 2, 128, 4, 2>::kCtasPerSm == 1 &&
                  GroupedConfig<2, 2, 128, 4, 2>::kRows == 128,
              "the wgmma form's 128-row CTAs: six 32 KB stages, one CTA per SM");
static_assert(GroupedConfig<2, 1, 256, 4>::kTile == 32 && GroupedConfig<2, 1, 256, 4>::kStages == 4 &&
                  GroupedConfig<2, 1, 256, 4>::kCtasPerSm == 2 &&
                  GroupedConfig<2, 1, 192, 4>::kStages == 6 && GroupedConfig<2, 1, 192, 4>::kCtasPerSm == 2,
              "the fp8 wide row split: 32-token tiles, two CTAs per SM");

// Whether the row split (GroupedConfig's kRowBlocks > 1) exists for queries of
// qelem bytes: 16-bit queries (the tensor cores), with any cache dtype and head size.
constexpr bool RowSplitAvailable(int qelem) { return qelem == 2; }

// Whether the row split's 64-row CTAs can run on the tensor cores' warpgroup
// products (wgmma, grouped_attention.cuh's kWgmma): 16-bit caches of the query's
// dtype, head_size % 16 == 0 (the Q.K products take 16 dims at a time), above 64.
// (Head size 64 runs four CTAs per SM at 128 registers per thread: too few for the
// second S tile that lets Q.K overlap the softmax.)
constexpr bool WgmmaRowSplitAvailable(int qelem, int celem, int d) {
  return RowSplitAvailable(qelem) && celem == 2 && !WideRowSplitHead(d) && d % 16 == 0 && d >= 80;
}

// KernelOptions::row_split switches the row split off.
inline bool RowSplitEnabled() { return GetKernelOptions().row_split; }

// Query rows of one KV head in a call: q_len * group (the grouped kernel's rows).
inline int RowsPerKvHead(const PagedAttentionParams& p) {
  return (p.num_heads / p.num_kv_heads) * p.q_len;
}

// Partitions in the grouped kernel's grid (its z dimension): the workspace's
// max_num_partitions, or with a sliding window and a split at most the
// partitions one CTA's rows can touch, the kernel counting them from the
// partition of the rows' first token (so that the partitions before a window
// cost no CTAs). A CTA's rows span at most
// sliding_window + q_len - 1 tokens (the last row's window ends q_len - 1
// tokens after the first's), which touch at most ceil(span / partition_size) + 1
// partitions.
inline int GroupedGridPartitions(const PagedAttentionParams& p) {
  const int parts = p.max_num_partitions;
  if (p.sliding_window <= 0 || parts <= 1) return parts;
  const int64_t span = int64_t{p.sliding_window} + p.q_len - 1;
  const int64_t touched = (span + p.partition_size - 1) / p.partition_size + 1;
  return static_cast<int>(std::min<int64_t>(parts, touched));
}

// Row blocks per CTA (GroupedConfig's kRowBlocks) of the kernel a call with these
// element sizes, head size, query length and rows per KV head (q_len * group)
// runs: for multi-token queries (q_len > 1) with more than 16 rows per KV head,
// where the row split is available and on, as few 16-row blocks as hold the
// rows, up to 4; else 1. The one rule for the kernel choice (SelectGroupedKernel)
// and the layout reported to Python (GroupedInfo). (Decode steps keep 16-row CTAs,
// which measured faster than 32-row ones there.)
inline int RowBlocks(int qelem, int celem, int d, int q_len, int rows_per_kv_head) {
  if (!RowSplitAvailable(qelem) || q_len <= 1 || rows_per_kv_head <= kMaxRows ||
      !RowSplitEnabled())
    return 1;
  if (rows_per_kv_head <= 2 * kMaxRows) {
    if (TwoRowBlocksAvailable(d)) return 2;
    // fp8 caches with 17-32 rows per KV head at head sizes 192 and 256: two 16-row
    // decode CTAs, faster than one 64-row CTA half idle.
    if (celem == 1) return 1;
  }
  return 4;
}

// f(std::integral_constant<int, RowBlocks(...)>{}) for a kernel of these element
// sizes and head size: the one place where a call's row blocks become a template
// argument (the kernel choice, SelectGroupedKernel, and the layout, GroupedInfo).
// Row blocks other than 1 are instantiated only where RowSplitAvailable.
template <int QELEM, int CELEM, int D, typename F>
auto WithRowBlocks(int q_len, int rows_per_kv_head, F&& f) {
  if constexpr (RowSplitAvailable(QELEM)) {
    switch (RowBlocks(QELEM, CELEM, D, q_len, rows_per_kv_head)) {
      case 4: return f(std::integral_constant<int, 4>{});
      case 2:
        if constexpr (TwoRowBlocksAvailable(D)) return f(std::integral_constant<int, 2>{});
        break;
      default: break;
    }
  }
  return f(std::integral_constant<int, 1>{});
}

// Work items of a call at or below which the fp8 decode kernels run two CTAs per
// SM (GroupedConfig's kFp8Ctas = 2) rather than four. A work item is one CTA's
// share of a partition: a (sequence, KV head, 16 query rows). With at most 32 of
// them four CTAs per SM cut partitions of ~512 tokens (16+ splits over 528 slots),
// two cut ~1024: half the CTAs whose prologue, last tile and epilogue the call
// pays, and a smaller merge. Above 32 items four CTAs per SM are as fast or faster.
constexpr int kFp8TwoCtasMaxWorkItems = 32;

// The fp8 decode kernels' CTAs per SM (kFp8Ctas: 2, or 0 for the default four)
// for a call of `work_items` work items (see kFp8TwoCtasMaxWorkItems).
// KernelOptions::fp8_ctas (2 or 4) forces one form for every call.
inline int Fp8CtasFor(int64_t work_items) {
  switch (GetKernelOptions().fp8_ctas) {
    case 2: return 2;
    case 4: return 0;
    default: return work_items <= kFp8TwoCtasMaxWorkItems ? 2 : 0;
  }
}

// f(row_blocks, fp8_ctas), both std::integral_constant: WithRowBlocks's row blocks,
// and for the fp8 decode kernels with 16 KB stages (one row block, head sizes up to
// 128) Fp8CtasFor's CTAs per SM for the call's `num_seqs * num_kv_heads` (times its
// kMaxRows-row chunks), else 0. What the kernel choice (SelectGroupedKernel) and the
// layout reported to Python (GroupedInfo) both use.
template <int QELEM, int CELEM, int D, typename F>
auto WithGroupedLayout(int q_len, int rows_per_kv_head, int64_t seq_kv_heads, F&& f) {
  return WithRowBlocks<QELEM, CELEM, D>(q_len, rows_per_kv_head, [&](auto row_blocks) {
    if constexpr (Fp8CtasVaried(QELEM, CELEM, D, decltype(row_blocks)::value)) {
      const int64_t chunks = (rows_per_kv_head + kMaxRows - 1) / kMaxRows;
      if (Fp8CtasFor(seq_kv_heads * chunks) == 2)
        return f(row_blocks, std::integral_constant<int, 2>{});
    }
    return f(row_blocks, std::integral_constant<int, 0>{});
  });
}

// Dynamic shared memory of one CTA, CTAs per SM and query rows per CTA
// (GroupedConfig) of the kernel a call with `rows_per_kv_head` query rows per KV
// head (q_len * group), query length `q_len` and `seq_kv_heads` (sequence, KV
// head) pairs (num_seqs * num_kv_heads) runs; smem_bytes and ctas_per_sm
// are 0 for an unsupported head size or query / cache combination.
struct GroupedKernelInfo {
  size_t smem_bytes = 0;
  int ctas_per_sm = 0;
  int rows_per_cta = 16;
};
GroupedKernelInfo GroupedInfo(ScalarKind query_kind, CacheKind cache_kind, int head_size,
                              int rows_per_kv_head, int q_len, int64_t seq_kv_heads);

// Launches the grouped kernel over the V2 workspace of `p` and, when
// p.max_num_partitions > 1, the V2 reduce kernel (paged_attention.cuh);
// with a single partition the kernel writes p.out (and p.lse) directly. T:
// query / output type, TC: cache type (T, or an fp8 type with a 16-bit T).
// The caller has checked shapes, block size (8, 16 or 32), alignment, the
// device (sm_90+) and that GroupedInfo().smem_bytes fits. Returns cudaGetLastError().
template <typename T, typename TC, int HEAD_SIZE>
cudaError_t LaunchGroupedAttention(const PagedAttentionParams& p, int device, cudaStream_t stream);

}  // namespace grouped
}  // namespace cuda
}  // namespace jax_paged
