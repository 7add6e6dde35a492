// The page loader of the portable grouped kernel: copies a tile (kTile tokens,
// one to four pages) of K and V of one KV head from the paged caches into a
// shared-memory stage with 16-byte cp.async copies (8-byte ones for the 8-byte
// rows of 8-token fp8 value pages), through the block table, and publishes the
// tile's token-valid bits. Invalid pages (id outside [0, num_blocks)) and pages
// past the CTA's range are never read; their tokens' bits are 0.
//
// The copies rearrange the cache layout into the one the products read: K's
// [D/x][BS][x] pages become rows of one token ([kTile][D]), V's [D][BS] pages
// rows of one dim ([D][kTile]), both padded (PortableConfig). Consecutive
// threads copy consecutive 16-byte chunks of a page (coalesced reads).
// Framework-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/sm80/config.h"
#include "cuda/sm80/ptx.cuh"
#include "cuda/sm80/variant.cuh"
#include "params.h"

namespace jax_paged {
namespace cuda {
namespace sm80 {

constexpr int kMaxTilePages = kTile / 8;  // pages per tile at the smallest block size

template <typename TC, int D>
struct PageLoader {
  using C = PortableConfig<static_cast<int>(sizeof(TC)), D>;
  static constexpr int kCelem = static_cast<int>(sizeof(TC));

  const TC* key;    // the KV head's slice of block 0 (add phys * block_stride)
  const TC* value;
  const int32_t* table;  // the sequence's block-table row
  int64_t block_stride;  // elements per physical block (all KV heads)
  int64_t num_blocks;
  uint32_t smem;    // shared address of stage 0
  uint32_t* mask_s;
  int bs, log2_bs, ppt;        // block size, its log2, pages per tile
  int start_blk, end_blk;      // the CTA's blocks [start_blk, end_blk)
  int tok_lo, tok_hi;          // the CTA's tokens
  int v_chunk, log2_v_cpr;     // V elements per copy, log2 of copies per page row

  __device__ __forceinline__ void Init(const PagedAttentionParams& p, const CtaWork& w,
                                       unsigned char* smem_base, int block_size) {
    bs = block_size;
    log2_bs = __ffs(bs) - 1;
    ppt = kTile >> log2_bs;
    const int64_t page_elems = static_cast<int64_t>(D) * bs;
    block_stride = static_cast<int64_t>(p.num_kv_heads) * page_elems;
    key = static_cast<const TC*>(p.key_cache) + w.kv_head * page_elems;
    value = static_cast<const TC*>(p.value_cache) + w.kv_head * page_elems;
    table = p.block_tables + static_cast<int64_t>(w.seq) * p.max_blocks_per_seq;
    num_blocks = p.num_blocks;
    smem = SmemAddr(smem_base);
    mask_s = reinterpret_cast<uint32_t*>(smem_base + C::kMaskOff);
    tok_lo = w.tok_lo;
    tok_hi = w.tok_hi;
    start_blk = tok_lo >> log2_bs;
    end_blk = (tok_hi + bs - 1) >> log2_bs;
    v_chunk = min(16 / kCelem, bs);
    log2_v_cpr = log2_bs - (__ffs(v_chunk) - 1);
  }

  __device__ __forceinline__ int NumTiles() const { return (end_blk - start_blk + ppt - 1) / ppt; }

  // The block-table entries of tile `tile` (-1 past the CTA's blocks).
  __device__ __forceinline__ void LoadEntries(int tile, int32_t (&ent)[kMaxTilePages]) const {
#pragma unroll
    for (int i = 0; i < kMaxTilePages; ++i) {
      const int blk = start_blk + tile * ppt + i;
      ent[i] = (i < ppt && blk < end_blk) ? table[blk] : -1;
    }
  }

  __device__ __forceinline__ bool Valid(int32_t e) const { return e >= 0 && e < num_blocks; }

  // ent[pg] without a dynamically indexed register array.
  __device__ __forceinline__ static int32_t Entry(const int32_t (&ent)[kMaxTilePages], int pg) {
    return pg == 0 ? ent[0] : pg == 1 ? ent[1] : pg == 2 ? ent[2] : ent[3];
  }

  // Issues the copies of tile `tile` into `stage` (all threads; the caller
  // commits the group) and thread 0 stores the tile's token-valid bits.
  __device__ __forceinline__ void Issue(int tile, int stage, const int32_t (&ent)[kMaxTilePages],
                                        int tid) const {
#if JAX_PAGED_SM80_DEVICE
    const uint32_t base = smem + static_cast<uint32_t>(stage * C::kStageBytes);
    constexpr int kCpr = D * kCelem / 16;  // K chunks per token of a page
    // K chunk i of the tile: (page, chunk c, token o) with o fastest, i.e. the
    // page's own order ([D/x][BS][x]).
#pragma unroll
    for (int j = 0; j < (C::kKChunks + kThreads - 1) / kThreads; ++j) {
      const int i = tid + j * kThreads;
      if (C::kKChunks % kThreads == 0 || i < C::kKChunks) {
        const int o = i & (bs - 1);
        const int rest = i >> log2_bs;
        const int pg = rest / kCpr;
        const int c = rest - pg * kCpr;
        const int32_t e = Entry(ent, pg);
        if (Valid(e)) {
          const TC* src = key + e * block_stride + (c * bs + o) * C::kX;
          CpAsync16(base + (pg * bs + o) * C::kKRowBytes + c * 16, src);
        }
      }
    }
    // V chunk i: (page, dim d, chunk cc of the page row) with cc fastest.
    const uint32_t vbase = base + C::kKBytes;
    const int v_chunks = (kTile * D) / v_chunk;
    for (int i = tid; i < v_chunks; i += kThreads) {
      const int cc = i & ((1 << log2_v_cpr) - 1);
      const int rest = i >> log2_v_cpr;
      const int pg = rest / D;
      const int d = rest - pg * D;
      const int32_t e = Entry(ent, pg);
      if (Valid(e)) {
        const TC* src = value + e * block_stride + d * bs + cc * v_chunk;
        const uint32_t dst = vbase + d * C::kVRowBytes + (pg * bs + cc * v_chunk) * kCelem;
        if (v_chunk * kCelem == 16)
          CpAsync16(dst, src);
        else
          CpAsync8(dst, src);
      }
    }
    if (tid == 0) {
      const int tok0 = (start_blk + tile * ppt) << log2_bs;
      const uint32_t page_bits = bs == 32 ? 0xFFFFFFFFu : (1u << bs) - 1u;
      uint32_t bits = 0u;
#pragma unroll
      for (int pg = 0; pg < kMaxTilePages; ++pg)
        if (pg < ppt && Valid(ent[pg])) bits |= page_bits << (pg * bs);
      // Tokens [tok_lo, tok_hi) of the tile only.
      const int lo = max(tok_lo - tok0, 0), hi = min(tok_hi - tok0, kTile);
      const uint32_t below_hi = hi >= 32 ? 0xFFFFFFFFu : (hi <= 0 ? 0u : (1u << hi) - 1u);
      const uint32_t below_lo = lo >= 32 ? 0xFFFFFFFFu : (lo <= 0 ? 0u : (1u << lo) - 1u);
      mask_s[stage] = bits & below_hi & ~below_lo;
    }
#endif
  }
};

}  // namespace sm80
}  // namespace cuda
}  // namespace jax_paged
