// Compile-time configuration of the portable grouped decode kernel (sm_80 and
// newer): CTA shape, tile, shared-memory layout and pipeline depth. Host-visible
// and framework-free; the kernel is in kernel.cuh.
//
// One CTA of kThreads threads per (KV head, sequence, partition, row chunk)
// computes up to kRows query rows of one KV head. A tile is kTile tokens of K
// and V in shared memory; warp w takes the 16-token slice w / 2 of every tile
// and the half w % 2 of the head dims in P.V (both warps of a slice compute the
// slice's logits: Q.K is cheap next to the bytes, and the split halves the
// output registers at head size 256).
#pragma once

namespace jax_paged {
namespace cuda {
namespace sm80 {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 16;           // query rows per CTA: the M of mma.m16n8k16
constexpr int kTile = 32;           // tokens per stage (one to four pages)
constexpr int kSlices = 2;          // 16-token slices per tile
constexpr int kWarpsPerSlice = kWarps / kSlices;
constexpr int kStageBudget = 48 * 1024;  // bytes of stages a CTA aims at
constexpr int kMinStages = 2;
constexpr int kMaxStages = 8;
static_assert(kSlices * 16 == kTile, "a slice is one mma's 16 tokens");

constexpr int Clamp(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }
// A row of `bytes` bytes padded to an odd number of 16-byte units, so that the 8
// rows one ldmatrix (or one 32-bit load per lane group) reads fall in 8 different
// 16-byte bank groups.
constexpr int OddRowBytes(int bytes) {
  return ((bytes / 16) % 2 == 1 ? bytes / 16 : bytes / 16 + 1) * 16;
}

// CELEM: bytes of one cache element (2: the query's f16 / bf16; 1: fp8, widened
// to f16 in registers). D: head size.
template <int CELEM, int D>
struct PortableConfig {
  static constexpr bool kFp8 = CELEM == 1;
  static_assert(CELEM == 1 || CELEM == 2, "16-bit or fp8 caches");
  static_assert(D % 8 == 0 && D >= 16 && D <= 256, "head size: a multiple of 8 up to 256");
  static_assert(!kFp8 || D % 16 == 0, "fp8 caches need head_size % 16 == 0");
  static constexpr int kX = 16 / CELEM;  // elements of one K chunk (the cache layout's x)
  // Stage layout: K as [kTile tokens][D] (one row per token), then V as [D][kTile]
  // (one row per dim), rows padded by OddRowBytes.
  static constexpr int kKRowBytes = OddRowBytes(D * CELEM);
  static constexpr int kVRowBytes = OddRowBytes(kTile * CELEM);
  static constexpr int kKBytes = kTile * kKRowBytes;
  static constexpr int kVBytes = D * kVRowBytes;
  static constexpr int kStageBytes = kKBytes + kVBytes;
  static constexpr int kStages = Clamp(kStageBudget / kStageBytes, kMinStages, kMaxStages);
  static constexpr int kKChunks = kTile * D * CELEM / 16;  // 16-byte K copies per stage
  // After the stages: per stage the tile's token-valid bits, then the epilogue's
  // per-slice row max and sum ([kSlices][kRows][2] float).
  static constexpr int kMaskOff = kStages * kStageBytes;
  static constexpr int kMlOff = (kMaskOff + kStages * 4 + 15) / 16 * 16;
  static constexpr int kSmemBytes = kMlOff + kSlices * kRows * 2 * 4;
  // P.V output tiles of 8 dims: kNTiles in all, kNTilesPerWarp per warp (the
  // second half one short when kNTiles is odd).
  static constexpr int kNTiles = D / 8;
  static constexpr int kNTilesPerWarp = (kNTiles + 1) / 2;
  static constexpr int kKSteps = D / 16;        // Q.K steps of 16 dims
  static constexpr bool kKTail = D % 16 != 0;   // and one of 8 (D = 8 mod 16)
  // The epilogue's merge buffer over the stages: [kRows][kObufStride] float.
  static constexpr int kObufStride = D + 8;
  static_assert(kRows * kObufStride * 4 <= kMaskOff, "merge buffer within the stages");
  // Registers: the query's fragments (D / 8 per lane) and the output's (D / 4)
  // grow with the head size; the minimum resident CTAs bound the compiler's
  // register budget (65536 / (kThreads * kMinBlocks) per thread: 128, 170, 255).
  // At 128 registers head sizes 96 and 112 spilled, at 170 fp8 at 192 (sm_80).
  static constexpr int kMinBlocks = D <= 80 ? 4 : (D <= 128 || (D <= 192 && !kFp8) ? 3 : 2);
};

// Resident CTAs per SM for `smem_bytes` of dynamic shared memory on a device of
// `smem_per_sm` bytes per SM (1 KB reserved per CTA), at most `cap`.
constexpr int PortableCtasPerSm(int smem_bytes, int smem_per_sm, int cap) {
  return Clamp(smem_per_sm / (smem_bytes + 1024), 1, cap);
}

}  // namespace sm80
}  // namespace cuda
}  // namespace jax_paged
