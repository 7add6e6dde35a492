// How fast can warpgroup products (wgmma, sm_90a) do the arithmetic of a
// q_len = 16, group-4 tile (64 query rows x 64 tokens, head 128, bf16) when
// nothing waits for memory? The grouped kernel's own arithmetic alone
// (JAX_PAGED_PROBE_NO_LOADS) is the yardstick: the mma.sync row split at
// 64 x 32 x 8 x 4096 (512 CTAs x 64 tiles) takes about as long as the whole
// decode step. This program times candidate forms of the inner loop on the
// same amount of work (512 items of 64 tiles, 68.7 GFLOP), with the pages
// already in shared memory, laid out as the kernel's bulk copies leave them:
//
//   K: a page's own layout [D/8][16][8], a K-major B operand without swizzle
//      (core matrix 8 tokens x 16 bytes, LBO 256 bytes, SBO 128): Q.K as one
//      m64n16k16 product per page and 16 dims (32 per tile);
//   V: a page's [D][16] rows with the 32-byte swizzle (what a tensor-map copy
//      with CU_TENSOR_MAP_SWIZZLE_32B writes): P.V as two m64n64k16 products
//      per page (8 per tile).
//
// (Q.K also as m64n32k16 products across the tile's pages.) Each tile issues
// its Q.K together with the previous tile's P.V, waits, then does the online
// softmax (base 2, fp32) and packs P to bf16 in registers.
//   form 1  one warpgroup per CTA (128 threads; two CTAs per SM overlap).
//   form 2  two consumer warpgroups per CTA taking alternate tiles of the
//           item, their product issues ordered by named barriers (one's
//           products run while the other does its softmax: FlashAttention-3's
//           ping-pong), merged exactly at the end through shared memory.
//   form 1 with fp8 pages: the stages hold e4m3 pages in the fp8 caches'
//           layouts (K [D/16][16][16] bytes, V [D][16]); the warpgroup widens
//           each tile once (exactly, to f16) into buffers laid out as form 1's
//           16-bit stages (two for K, three for V), fences them for the tensor
//           cores and runs form 1's m64n32k16 products in f16 (f16 query rows).
//           Either at the start of each tile (widen, CTA barrier, products) or
//           one tile ahead (tile t + 1 widened while tile t's products run).
//           The kernel's fp8 row split widens every K and V value of a tile in
//           each of its four warps, for its own 16 rows; this asks whether
//           widening once per CTA into shared memory for wgmma would do the
//           arithmetic faster.
//   form 3  "swap A and B": S^T = K Q^T and O^T = V^T P^T,
//           K and V the products' A operands from registers (ldmatrix of the
//           pages as they are; fp8 pages widened in registers, each value once
//           per CTA), Q^T and P^T the B operands in shared memory, m64n64k16
//           products (the tile's 64 tokens as M, the 64 query rows as N); a
//           query row's max over the four warps' tokens through shared memory,
//           P^T stored by stmatrix.trans. It asks whether fp8 q_len 16 can do
//           its arithmetic without widening into shared memory (the rows above)
//           and at n64 instead of n32.
//   form 4 / 4b: e4m3 products with the 16-bit operands split in two e4m3
//           terms (below); 4b's accuracy variants take the Q.K products in two
//           chains or one at a time, and P.V fresh per tile, each added in fp32
//           (SplitLoop).
// All are checked first against a float64 CPU computation (1, 2 and 5 tiles);
// then the error over long chains (64 and 512 tiles, "chain" rows, measured and
// not gated), with the split forms' lse error.
//
// Build and run (CMake builds it as jax_paged_wgmma_ceiling with
// -DJAX_PAGED_DEV=ON; or directly):
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr \
//       -gencode=arch=compute_90a,code=sm_90a -Icsrc \
//       dev/wgmma_ceiling.cu -o wgmma_ceiling && ./wgmma_ceiling
//
// Output: the checks, then per form and Q.K shape the resident CTAs per SM, the
// median of 20 timed launches (us) and the rate in TFLOP/s (4 * 64 * 128 flops
// per token and item). One row repeats the m64n32k16 form with 100 KB of shared
// memory per CTA: two CTAs per SM, as the grouped kernel's 64-row CTAs have.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/grouped_attention.cuh"  // SmemAddr, FenceProxyAsyncShared, PackPair; wgmma.cuh

namespace {

// The kernel library's helpers: SmemAddr, PackPair, the wgmma wrappers and descriptors.
using namespace jax_paged::cuda::grouped;  // NOLINT(build/namespaces)

// ---- e4m3 operands and products (forms 4 / 4b only) --------------------------
// A value the fp8 products take at about 16-bit precision is split into two e4m3
// terms, v = hi + lo, both multiplied into the same accumulators: hi is v with its
// mantissa cut to 3 bits (exact in e4m3 for |v| in [2^-6, 448]) and lo = v - hi
// (exact in float, rounded to e4m3). hi + lo keeps about 8 significant bits (a
// bf16 value exactly, given the range), and two e4m3 products take the time of
// one 16-bit product.
__device__ __forceinline__ float CutMantissa3(float v) {
  return __uint_as_float(__float_as_uint(v) & 0xFFF00000u);
}
// Four floats as e4m3 bytes (byte i = v_i), rounded to nearest even, saturated.
__device__ __forceinline__ uint32_t PackE4m3x4(float v0, float v1, float v2, float v3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v2, v3), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}
__device__ __forceinline__ void SplitE4m3x4(const float (&v)[4], uint32_t& hi, uint32_t& lo) {
  float h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = CutMantissa3(v[i]);
  hi = PackE4m3x4(h[0], h[1], h[2], h[3]);
  lo = PackE4m3x4(v[0] - h[0], v[1] - h[1], v[2] - h[2], v[3] - h[3]);
}

// An 8-bit A fragment register from 16-bit-layout accumulators: lane tq of a quad
// holds a page's tokens {2 tq, 2 tq + 1, 8 + 2 tq, 9 + 2 tq} (S's columns in two
// 8-token n-tiles) as bytes 0-3 of `w`, and the 8-bit layout wants tokens 4 tq ..
// 4 tq + 3: bytes 0, 1 (tq < 2) or 2, 3 (tq >= 2) of lanes 2 (tq & 1) and
// 2 (tq & 1) + 1 of the quad. All 32 lanes call it.
__device__ __forceinline__ uint32_t QuadGatherBytes(uint32_t w, int lane) {
  const int tq = lane & 3;
  const int src = lane - tq + 2 * (tq & 1);
  const uint32_t x = __shfl_sync(0xffffffffu, w, src);
  const uint32_t y = __shfl_sync(0xffffffffu, w, src + 1);
  return __byte_perm(x, y, tq < 2 ? 0x5410u : 0x7632u);
}

// e4m3 x e4m3 -> f32 products, K = 32 (twice the 16-bit rate): A from registers
// in the 8-bit layout (warp w's rows 16 w + gid and + 8; lane tq holds bytes
// 4 tq .. 4 tq + 3 of each 16-element K half: registers (gid, k 0-15), (gid + 8,
// k 0-15), (gid, k 16-31), (gid + 8, k 16-31)), B K-major from `desc` (fp8
// operands have no transposed form). Accumulators as the 16-bit products'.
#define CEIL_A4(a) "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])
#define CEIL_TILE(C, d) C(d[0]), C(d[1]), C(d[2]), C(d[3])
#define CEIL_RW(x) "+f"(x)
#define CEIL_W(x) "=f"(x)
// (d0..d3) (+)= a * B over 32 columns; kAccumulate false: = a * B.
template <bool kAccumulate>
__device__ __forceinline__ void WgmmaE4m3N32(float (&d0)[4], float (&d1)[4], float (&d2)[4],
                                             float (&d3)[4], const uint32_t (&a)[4],
                                             uint64_t desc) {
#if JAX_PAGED_WGMMA_DEVICE
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
               "{%16, %17, %18, %19}, %20, p, 1, 1;\n}"
               : CEIL_TILE(CEIL_RW, d0), CEIL_TILE(CEIL_RW, d1), CEIL_TILE(CEIL_RW, d2),
                 CEIL_TILE(CEIL_RW, d3)
               : CEIL_A4(a), "l"(desc), "r"(kAccumulate ? 1 : 0));
#else
  __trap();
#endif
}
// o[N0 .. N0 + 8) += a * B, 64 columns of B from `desc` (kAccumulate false: = a * B,
// the old values unused).
#define CEIL_N64(SCALE_D, C)                                                                   \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "                         \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "       \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
               "{%32, %33, %34, %35}, %36, " SCALE_D ", 1, 1;"                                 \
               : CEIL_TILE(C, o[N0 + 0]), CEIL_TILE(C, o[N0 + 1]), CEIL_TILE(C, o[N0 + 2]),     \
                 CEIL_TILE(C, o[N0 + 3]), CEIL_TILE(C, o[N0 + 4]), CEIL_TILE(C, o[N0 + 5]),     \
                 CEIL_TILE(C, o[N0 + 6]), CEIL_TILE(C, o[N0 + 7])                              \
               : CEIL_A4(a), "l"(desc))
template <int N0, int kNT, bool kAccumulate = true>
__device__ __forceinline__ void WgmmaE4m3AccN64(float (&o)[kNT][4], const uint32_t (&a)[4],
                                                uint64_t desc) {
  static_assert(N0 + 8 <= kNT, "n-tiles");
#if JAX_PAGED_WGMMA_DEVICE
  if constexpr (kAccumulate)
    CEIL_N64("1", CEIL_RW);
  else
    CEIL_N64("0", CEIL_W);
#else
  __trap();
#endif
}
#undef CEIL_N64
#undef CEIL_W
#undef CEIL_RW
#undef CEIL_TILE
#undef CEIL_A4
using T = __nv_bfloat16;
using Fp8 = __nv_fp8_e4m3;

constexpr int kD = 128;                 // head size
constexpr int kBS = 16;                 // tokens per page
constexpr int kPages = 4;               // pages per tile
constexpr int kTile = kPages * kBS;     // tokens per tile
constexpr int kRows = 64;               // query rows (q_len 16 x group 4)
constexpr int kPageBytes = kD * kBS * 2;
constexpr int kStageBytes = 2 * kPages * kPageBytes;  // K pages, then V pages
constexpr int kStages = 2;              // distinct tiles in shared memory
constexpr int kSmemBytes = kStages * kStageBytes;     // 64 KB
constexpr int kNT = kD / 8;             // P.V n-tiles (8 dims) per thread
// fp8 forms: the stages (fp8 K pages, then V pages), then the widened tiles'
// K buffers (two) and V buffers (three: tile t + 1 is widened while tile t's
// Q.K and tile t - 1's P.V read theirs), each laid out as a 16-bit stage's half.
constexpr int kFp8PageBytes = kD * kBS;
constexpr int kFp8StageBytes = 2 * kPages * kFp8PageBytes;  // 16 KB
constexpr int kHalfBytes = kPages * kPageBytes;              // K or V of a 16-bit tile: 16 KB
constexpr int kKbufOff = kStages * kFp8StageBytes;
constexpr int kVbufOff = kKbufOff + 2 * kHalfBytes;
constexpr int kFp8SmemBytes = kVbufOff + 3 * kHalfBytes;     // 112 KB: two CTAs per SM

#define CUDA_OK(x)                                                                     \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__device__ __forceinline__ void NamedSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The stages as bulk copies would leave them, filled once per CTA by its
// threads: K pages copied as they are, V rows with the 32-byte swizzle (the two
// 16-byte halves of row d swapped when d & 4); fp8 pages as they are.
// kPermK (form 4): each 16-dim chunk's 16 token rows of an fp8 K page in the
// order R = 8 b + 2 a + c for token 4 a + 2 b + c (what a 5-d tensor map with
// token strides 16, 64 and 32 bytes would write), so that S's accumulators hold
// each lane's tokens 4 tq .. 4 tq + 3 of a page (form 4).
__host__ __device__ constexpr int PermKRow(int token) {
  return 8 * ((token >> 1) & 1) + 2 * (token >> 2) + (token & 1);
}
template <bool kFp8, bool kPermK = false>
__device__ void FillStages(unsigned char* smem, const void* k_glob, const void* v_glob) {
  const int tid = threadIdx.x;
  for (int i = tid; kFp8 && i < kStages * kFp8StageBytes / 16; i += blockDim.x) {
    const int byte = 16 * i;
    const int st = byte / kFp8StageBytes;
    const int in_st = byte - st * kFp8StageBytes;
    const bool is_k = in_st < kPages * kFp8PageBytes;
    const int src = st * kPages * kFp8PageBytes + (is_k ? in_st : in_st - kPages * kFp8PageBytes);
    int dst = i;  // 16-byte units
    if (kPermK && is_k) dst = i - (i & 15) + PermKRow(i & 15);  // a chunk: 16 rows of 16 bytes
    reinterpret_cast<uint4*>(smem)[dst] = static_cast<const uint4*>(is_k ? k_glob : v_glob)[src / 16];
  }
  for (int i = tid; !kFp8 && i < kSmemBytes / 16; i += blockDim.x) {
    const int byte = 16 * i;
    const int st = byte / kStageBytes;
    const int in_st = byte - st * kStageBytes;
    uint4 v;
    int dst = byte;
    if (in_st < kPages * kPageBytes) {
      v = static_cast<const uint4*>(k_glob)[(st * kPages * kPageBytes + in_st) / 16];
    } else {
      const int vb = in_st - kPages * kPageBytes;  // byte in the stage's V pages
      v = static_cast<const uint4*>(v_glob)[(st * kPages * kPageBytes + vb) / 16];
      const int row = (vb % kPageBytes) / 32;    // dim
      const int half = (vb / 16) & 1;
      dst = byte - 16 * half + 16 * (half ^ ((row >> 2) & 1));
    }
    *reinterpret_cast<uint4*>(smem + dst) = v;
  }
}

// Forms 1, 2 and 4: a tile's S (s[page][n-tile][4], rows row0 and row0 + 8 of
// the thread, their logits in log2 units after scaling by row_scale[0 / 1]):
// the rows' new running maxima over the lane quad, with O and the sums rescaled.
__device__ __forceinline__ void RescaleRows(const float (&s)[kPages][2][4],
                                            const float (&row_scale)[2], float (&m_run)[2],
                                            float (&l_run)[2], float (&o)[kNT][4]) {
  float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
  for (int p = 0; p < kPages; ++p)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      mx[0] = fmaxf(mx[0], fmaxf(s[p][n][0], s[p][n][1]) * row_scale[0]);
      mx[1] = fmaxf(mx[1], fmaxf(s[p][n][2], s[p][n][3]) * row_scale[1]);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
  const float alpha[2] = {exp2f(m_run[0] - mx[0]), exp2f(m_run[1] - mx[1])};
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
    o[n][0] *= alpha[0];
    o[n][1] *= alpha[0];
    o[n][2] *= alpha[1];
    o[n][3] *= alpha[1];
  }
  l_run[0] *= alpha[0];
  l_run[1] *= alpha[1];
  m_run[0] = mx[0];
  m_run[1] = mx[1];
}
// The rows' sums over the lane quad.
__device__ __forceinline__ void QuadSums(float (&l_run)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
}
// O / l of the thread's rows row0, row0 + 8 into o_out ([kRows][kD] float).
__device__ __forceinline__ void WriteRows(const float (&o)[kNT][4], const float (&l_run)[2],
                                          float* o_out, int row0, int tq) {
#pragma unroll
  for (int n = 0; n < kNT; ++n) {
    const int c = 8 * n + 2 * tq;
    o_out[row0 * kD + c] = o[n][0] / l_run[0];
    o_out[row0 * kD + c + 1] = o[n][1] / l_run[0];
    o_out[(row0 + 8) * kD + c] = o[n][2] / l_run[1];
    o_out[(row0 + 8) * kD + c + 1] = o[n][3] / l_run[1];
  }
}

// kWgs warpgroups per CTA (1: form 1; 2: form 2). One CTA per item: `tiles`
// tiles, tile t from stage t % 2; warpgroup g takes tiles g, g + kWgs, ...
// kN32: Q.K as m64n32k16 products over tokens 8 h..8 h + 7 of the tile's four
// pages (SBO = a page), half as many products as
// one m64n16k16 per page.
// kFp8: 0 bf16 pages; 1 e4m3 pages widened at each tile's start; 2 widened one
// tile ahead (form 1 with m64n32k16 only).
// k_glob: [kStages][kPages][D/8][16][8] bf16 or [kStages][kPages][D/16][16][16]
// e4m3, v_glob: [kStages][kPages][D][16] (unswizzled; swizzled on the way into
// shared memory, or by the widening), q_glob: [kRows][kD] bf16 (f16 for fp8
// pages), out: [items][kRows][kD] float.
template <int kWgs, bool kN32, int kFp8 = 0>
__global__ void __launch_bounds__(128 * kWgs, 3 - kWgs)
    TileLoop(const void* __restrict__ k_glob, const void* __restrict__ v_glob,
             const uint16_t* __restrict__ q_glob, float* __restrict__ out, int tiles,
             float scale_log2) {
  static_assert(kFp8 == 0 || (kWgs == 1 && kN32), "fp8 pages: form 1, m64n32k16");
  using TM = std::conditional_t<kFp8 != 0, __half, T>;  // the products' operand type
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x;
  const int wg = tid >> 7;
  const int wtid = tid & 127;
  const int warp = wtid >> 5;
  const int lane = tid & 31;
  const int gid = lane >> 2;
  const int tq = lane & 3;
  const int row0 = 16 * warp + gid;  // this thread's rows: row0, row0 + 8

  FillStages<kFp8 != 0>(smem, k_glob, v_glob);
  FenceProxyAsyncShared();  // generic stores, then the tensor cores' reads
  __syncthreads();

  // Q as wgmma A fragments (mma.m16n8k16's A layout per warp), 16 dims per step.
  uint32_t q[kD / 16][4];
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const int c = 16 * kk + 2 * tq;
    q[kk][0] = *reinterpret_cast<const uint32_t*>(q_glob + row0 * kD + c);
    q[kk][1] = *reinterpret_cast<const uint32_t*>(q_glob + (row0 + 8) * kD + c);
    q[kk][2] = *reinterpret_cast<const uint32_t*>(q_glob + row0 * kD + c + 8);
    q[kk][3] = *reinterpret_cast<const uint32_t*>(q_glob + (row0 + 8) * kD + c + 8);
  }

  const uint32_t smem0 = SmemAddr(smem);
  const uint64_t k_desc = SmemDescriptor(16u * kBS, 128u, SmemSwizzle::kNone);
  const uint64_t k_desc32 = SmemDescriptor(16u * kBS, kPageBytes, SmemSwizzle::kNone);
  const uint64_t v_desc = SmemDescriptor(16u, 256u, SmemSwizzle::k32B);

  float o[kNT][4];
#pragma unroll
  for (int n = 0; n < kNT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  float s[kPages][2][4];
  uint32_t pa[kPages][4];  // P of the previous tile, as A fragments (one per page)
  int prev_tile = -1;

  // The tile's K and V as the products read them: a stage's halves, or (fp8)
  // the widened buffers.
  auto k_addr = [&](int t) -> uint32_t {
    return kFp8 ? smem0 + kKbufOff + (t & 1) * kHalfBytes : smem0 + (t & 1) * kStageBytes;
  };
  auto v_addr = [&](int t) -> uint32_t {
    return kFp8 ? smem0 + kVbufOff + (t % 3) * kHalfBytes
                : smem0 + (t & 1) * kStageBytes + kPages * kPageBytes;
  };
  // fp8: tile t's pages widened into its buffers (all 128 threads; four K units
  // of 16 dims x 1 token and four V rows of 16 tokens each), then fenced for
  // the tensor cores (the caller's CTA barrier orders the threads).
  auto widen = [&](int t) {
    const unsigned char* stage = smem + (t & 1) * kFp8StageBytes;
    unsigned char* kbuf = smem + kKbufOff + (t & 1) * kHalfBytes;
    unsigned char* vbuf = smem + kVbufOff + (t % 3) * kHalfBytes;
    auto widen16 = [](uint4 raw, uint4& lo, uint4& hi) {  // 16 fp8 -> 16 f16, in order
      Fp8x4ToHalf2x2<Fp8>(raw.x, lo.x, lo.y);
      Fp8x4ToHalf2x2<Fp8>(raw.y, lo.z, lo.w);
      Fp8x4ToHalf2x2<Fp8>(raw.z, hi.x, hi.y);
      Fp8x4ToHalf2x2<Fp8>(raw.w, hi.z, hi.w);
    };
#pragma unroll
    for (int j = 0; j < kPages * kD / 128; ++j) {
      const int i = wtid + 128 * j;
      const int p = i / kD;            // page
      const int r = i - p * kD;        // K: chunk r / 16 of 16 dims, token r % 16; V: dim r
      uint4 lo, hi;
      // K: fp8 [D/16][16][16] -> 16-bit [D/8][16][8]: dims 16 c.. to chunks 2 c, 2 c + 1.
      const int c = r >> 4, tok = r & 15;
      widen16(*reinterpret_cast<const uint4*>(stage + p * kFp8PageBytes + 16 * r), lo, hi);
      unsigned char* kpage = kbuf + p * kPageBytes;
      *reinterpret_cast<uint4*>(kpage + ((2 * c) * kBS + tok) * 16) = lo;
      *reinterpret_cast<uint4*>(kpage + ((2 * c + 1) * kBS + tok) * 16) = hi;
      // V: fp8 row r (16 tokens) -> 32 bytes, halves swapped when r & 4 (32-byte swizzle).
      widen16(*reinterpret_cast<const uint4*>(stage + kPages * kFp8PageBytes + p * kFp8PageBytes +
                                               16 * r),
              lo, hi);
      unsigned char* vrow = vbuf + p * kPageBytes + 32 * r;
      const int swz = (r >> 2) & 1;
      *reinterpret_cast<uint4*>(vrow + 16 * swz) = lo;
      *reinterpret_cast<uint4*>(vrow + 16 * (1 ^ swz)) = hi;
    }
    FenceProxyAsyncShared();  // generic stores, then the tensor cores' reads
  };

  // P.V of the previous tile (prev_tile) into o.
  auto issue_pv = [&]() {
    const uint32_t vbase = v_addr(prev_tile);
#pragma unroll
    for (int p = 0; p < kPages; ++p) {
      const uint32_t page = vbase + p * kPageBytes;
      WgmmaAccAll<TM, 0, kNT>(o, pa[p], [&](int col) { return WithStart(v_desc, page + col * 32); });
    }
  };

  const int other = 1 - wg;
  // One tile: its Q.K, with the previous tile's P.V when kWithPv (the first tile
  // has none: a separate instantiation, so that no branch sits between products),
  // then the online softmax into m_run, l_run, o and P (pa).
  auto tile_step = [&](int t, auto with_pv) {
    constexpr bool kWithPv = decltype(with_pv)::value;
    const uint32_t kbase = k_addr(t);
    if (kWgs == 2 && t > 0) NamedSync(1 + wg, 256);  // the other's products went first
    if constexpr (kFp8 == 1) widen(t);
    if constexpr (kFp8 != 0) __syncthreads();  // tile t widened by every thread
    WgmmaFence();
    if constexpr (kN32) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // tokens 8 h..8 h + 7 of every page
        const uint32_t base = kbase + h * 128;
        WgmmaN32<TM, false>(s[0][h], s[1][h], s[2][h], s[3][h], q[0], WithStart(k_desc32, base));
#pragma unroll
        for (int kk = 1; kk < kD / 16; ++kk)
          WgmmaN32<TM, true>(s[0][h], s[1][h], s[2][h], s[3][h], q[kk],
                            WithStart(k_desc32, base + kk * 512));
      }
    } else {
#pragma unroll
      for (int p = 0; p < kPages; ++p) {
        const uint32_t page = kbase + p * kPageBytes;
        WgmmaN16<TM, false>(s[p][0], s[p][1], q[0], WithStart(k_desc, page));
#pragma unroll
        for (int kk = 1; kk < kD / 16; ++kk)
          WgmmaN16<TM, true>(s[p][0], s[p][1], q[kk], WithStart(k_desc, page + kk * 512));
      }
    }
    if constexpr (kWithPv) issue_pv();
    WgmmaCommit();
    if (kWgs == 2 && t + 1 < tiles) NamedArrive(1 + other, 256);  // the other's turn
    // (Tile t + 1's buffers: its K one held tile t - 1, whose Q.K was waited for
    // in the last step; its V one tile t - 2, whose P.V likewise.)
    if (kFp8 == 2 && t + 1 < tiles) widen(t + 1);  // while the products run
    WgmmaWaitAll();

    // Online softmax over the tile (rows row0 = r 0, row0 + 8 = r 1).
    RescaleRows(s, {scale_log2, scale_log2}, m_run, l_run, o);
    const float (&mx)[2] = m_run;
#pragma unroll
    for (int p = 0; p < kPages; ++p) {
      float e[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          e[n][j] = exp2f(s[p][n][j] * scale_log2 - mx[j >> 1]);
          l_run[j >> 1] += e[n][j];
        }
      pa[p][0] = PackPair<TM>(e[0][0], e[0][1]);
      pa[p][1] = PackPair<TM>(e[0][2], e[0][3]);
      pa[p][2] = PackPair<TM>(e[1][0], e[1][1]);
      pa[p][3] = PackPair<TM>(e[1][2], e[1][3]);
    }
    prev_tile = t;
  };
  if (wg < tiles) {
    if constexpr (kFp8 == 2) widen(0);
    tile_step(wg, std::false_type{});
    for (int t = wg + kWgs; t < tiles; t += kWgs) tile_step(t, std::true_type{});
    WgmmaFence();  // the last tile's P.V
    issue_pv();
    WgmmaCommit();
    WgmmaWaitAll();
  }
  QuadSums(l_run);

  float* o_out = out + static_cast<size_t>(blockIdx.x) * kRows * kD;
  if constexpr (kWgs == 2) {
    // Warpgroup 1 hands (max, sum, unnormalised O) to warpgroup 0 through the stages.
    __syncthreads();
    float* obuf = reinterpret_cast<float*>(smem);       // [kRows][kD]
    float* mlbuf = obuf + kRows * kD;                    // [kRows][2]
    if (wg == 1) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        const int c = 8 * n + 2 * tq;
        obuf[row0 * kD + c] = o[n][0];
        obuf[row0 * kD + c + 1] = o[n][1];
        obuf[(row0 + 8) * kD + c] = o[n][2];
        obuf[(row0 + 8) * kD + c + 1] = o[n][3];
      }
      if (tq == 0) {
        mlbuf[2 * row0] = m_run[0];
        mlbuf[2 * row0 + 1] = l_run[0];
        mlbuf[2 * (row0 + 8)] = m_run[1];
        mlbuf[2 * (row0 + 8) + 1] = l_run[1];
      }
    }
    __syncthreads();
    if (wg == 1) return;
    float f0[2], f1[2], l_all[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      const float m1 = mlbuf[2 * row], l1 = mlbuf[2 * row + 1];
      const float m = fmaxf(m_run[r], m1);
      f0[r] = m_run[r] == -INFINITY ? 0.0f : exp2f(m_run[r] - m);
      f1[r] = m1 == -INFINITY ? 0.0f : exp2f(m1 - m);
      l_all[r] = l_run[r] * f0[r] + l1 * f1[r];
    }
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const int c = 8 * n + 2 * tq;
      o[n][0] = o[n][0] * f0[0] + obuf[row0 * kD + c] * f1[0];
      o[n][1] = o[n][1] * f0[0] + obuf[row0 * kD + c + 1] * f1[0];
      o[n][2] = o[n][2] * f0[1] + obuf[(row0 + 8) * kD + c] * f1[1];
      o[n][3] = o[n][3] * f0[1] + obuf[(row0 + 8) * kD + c + 1] * f1[1];
    }
    l_run[0] = l_all[0];
    l_run[1] = l_all[1];
  }
  WriteRows(o, l_run, o_out, row0, tq);
}

// Form 3: K and V as the products' A operands, from
// registers ("swap A and B"): S^T = K Q^T and O^T = V^T P^T. The tile's 64
// tokens are S^T's M rows (warp w: page w), the 64 query rows its N = 64
// columns (one m64n64k16 per 16 dims, half as many Q.K products as form 1's
// m64n32k16); O^T's M rows are the head's dims (two halves of 64), its columns
// the query rows. Q^T and P^T are the B operands, K-major in shared memory:
// [16-element K chunk / 8][64 rows][8], Q^T staged once per CTA, P^T written
// per tile by stmatrix.trans from S^T's accumulators. A warp reads each K and V
// value of its page once (ldmatrix), so fp8 pages are widened in registers,
// once per CTA, with no 16-bit copy in shared memory: read 4 bytes per lane
// (a b16 ldmatrix of 16-byte rows) and widened to two f16 pairs, lane tq's k =
// 2 tq + e holds element 4 tq + e of 16 and k = 8 + 2 tq + e element 4 tq + 2 +
// e (Perm16); Q^T's dims are staged in that order, and S^T's M rows (tokens)
// are read in it too, so that P^T's K order is the one V^T's fragments have.
// A query row's max is over the four warps' tokens: one exchange through
// shared memory per tile (and the sums once at the end).
constexpr int kSwapQBytes = kRows * kD * 2;       // Q^T: [kD / 8][kRows][8] of 16 bits
constexpr int kSwapPBytes = kTile * kRows * 2;    // P^T: [kTile / 8][kRows][8]
constexpr int kSwapRedBytes = 2 * kRows * 4 * 4;  // [2 (tile parity)][kRows][4 warps] float
constexpr int SwapStagesBytes(int fp8) { return fp8 ? kStages * kFp8StageBytes : kSmemBytes; }
constexpr int SwapSmem(int fp8) {
  return SwapStagesBytes(fp8) + kSwapQBytes + kSwapPBytes + kSwapRedBytes;
}

// The element of a 16-element K step that K index k holds (see form 3).
__host__ __device__ constexpr int Perm16(int k, bool fp8) {
  return !fp8 ? k : (k < 8 ? 4 * (k / 2) + k % 2 : 4 * ((k - 8) / 2) + 2 + k % 2);
}

// Four 8x8 16-bit matrices from mma fragments, each stored transposed: row i of
// matrix j (at lane 8 j + i's address) is column i of the fragment.
__device__ __forceinline__ void Stsm4T(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                       uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
// Registers an asynchronous product reads (A) or writes (accumulators): kept
// where they are, unread and unwritten by other code, until this point.
template <int N>
__device__ __forceinline__ void KeepRegs(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}
template <int N>
__device__ __forceinline__ void KeepRegs(float (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+f"(a[i][0]), "+f"(a[i][1]), "+f"(a[i][2]), "+f"(a[i][3])::"memory");
}

template <int kFp8>
__global__ void __launch_bounds__(128, 2)
    SwapLoop(const void* __restrict__ k_glob, const void* __restrict__ v_glob,
             const uint16_t* __restrict__ q_glob, float* __restrict__ out, int tiles,
             float scale_log2) {
  constexpr bool kF8 = kFp8 != 0;
  using TM = std::conditional_t<kF8, __half, T>;
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int gid = lane >> 2;
  const int tq = lane & 3;
  FillStages<kF8>(smem, k_glob, v_glob);
  constexpr int kQOff = SwapStagesBytes(kFp8);
  constexpr int kPOff = kQOff + kSwapQBytes;
  constexpr int kRedOff = kPOff + kSwapPBytes;
  // Q^T: K index i of row r (dim 16 (i / 16) + Perm16(i % 16)) at [i / 8][r][i % 8].
  for (int e = tid; e < kRows * kD; e += blockDim.x) {
    const int r = e / kD, i = e % kD;
    reinterpret_cast<uint16_t*>(smem + kQOff)[((i / 8) * kRows + r) * 8 + i % 8] =
        q_glob[r * kD + 16 * (i / 16) + Perm16(i % 16, kF8)];
  }
  FenceProxyAsyncShared();  // generic stores, then the tensor cores' reads
  __syncthreads();

  const uint32_t smem0 = SmemAddr(smem);
  const uint32_t q_addr = smem0 + kQOff, p_addr = smem0 + kPOff;
  float* red = reinterpret_cast<float*>(smem + kRedOff);
  const uint64_t b_desc = SmemDescriptor(16u * kRows, 128u, SmemSwizzle::kNone);
  const int sel = lane >> 3;  // the ldmatrix / stmatrix matrix this lane addresses

  uint32_t ka[kD / 16][4];           // K of this warp's page: [16-dim step] A fragments
  uint32_t va[2 * kPages][4];        // V^T: [dims half * kPages + page] A fragments
  float s[kRows / 8][4];             // S^T: [query-row n-tile]: tokens gid, gid + 8
  float o[2][kRows / 8][4];          // O^T: [dims half][query-row n-tile]
  float m_run[kRows / 4], l_run[kRows / 4];  // this thread's rows: c -> 8 (c / 2) + 2 tq + c % 2
#pragma unroll
  for (int c = 0; c < kRows / 4; ++c) {
    m_run[c] = -INFINITY;
    l_run[c] = 0.0f;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < kRows / 8; ++j) o[h][j][0] = o[h][j][1] = o[h][j][2] = o[h][j][3] = 0.0f;

  // K of tile t, page `warp`: M row m (lane's matrix sel: m = lane % 8 + 8 (sel & 1)) is
  // token Perm16(m); 16-bit pages [D/8][16][8] (one step: chunks 2 kk, 2 kk + 1), fp8
  // pages [D/16][16][16] bytes (one step: chunk kk, widened).
  auto load_k = [&](int t) {
    const int m = (lane & 7) + 8 * (sel & 1);
    if constexpr (!kF8) {
      const uint32_t row = smem0 + (t & 1) * kStageBytes + warp * kPageBytes + m * 16 + (sel >> 1) * 256;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) Ldsm4(ka[kk], row + kk * 512);
    } else {
      const uint32_t row = smem0 + (t & 1) * kFp8StageBytes + warp * kFp8PageBytes +
                           Perm16(m, true) * 16 + (sel >> 1) * 256;
#pragma unroll
      for (int kk = 0; kk < kD / 16; kk += 2) {
        uint32_t r[4];  // (M gid, step kk), (gid + 8, kk), (gid, kk + 1), (gid + 8, kk + 1)
        Ldsm4(r, row + kk * 256);
        Fp8x4ToHalf2x2<Fp8>(r[0], ka[kk][0], ka[kk][2]);
        Fp8x4ToHalf2x2<Fp8>(r[1], ka[kk][1], ka[kk][3]);
        Fp8x4ToHalf2x2<Fp8>(r[2], ka[kk + 1][0], ka[kk + 1][2]);
        Fp8x4ToHalf2x2<Fp8>(r[3], ka[kk + 1][1], ka[kk + 1][3]);
      }
    }
  };
  // V^T of tile t: dims 64 h + 16 warp + (0..15) by the tokens of page p. 16-bit V rows
  // (32 bytes, the 32-byte swizzle): matrices (dims +0 / +8) x (tokens 0-7 / 8-15);
  // fp8 V rows (16 bytes, every token of the page): matrices (dims +0 / +8) x (page p / p + 1).
  auto load_v = [&](int t) {
    const int dim_in = (lane & 7) + 8 * (sel & 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int dim = 64 * h + 16 * warp + dim_in;
      if constexpr (!kF8) {
        const uint32_t base = smem0 + (t & 1) * kStageBytes + kPages * kPageBytes + dim * 32 +
                              16 * ((sel >> 1) ^ ((dim >> 2) & 1));
#pragma unroll
        for (int p = 0; p < kPages; ++p) Ldsm4(va[h * kPages + p], base + p * kPageBytes);
      } else {
        const uint32_t base = smem0 + (t & 1) * kFp8StageBytes + kPages * kFp8PageBytes +
                              (sel >> 1) * kFp8PageBytes + dim * 16;
#pragma unroll
        for (int p = 0; p < kPages; p += 2) {
          uint32_t r[4];  // (dims +0, page p), (+8, p), (+0, p + 1), (+8, p + 1)
          Ldsm4(r, base + p * kFp8PageBytes);
          uint32_t(&a)[4] = va[h * kPages + p];
          uint32_t(&b)[4] = va[h * kPages + p + 1];
          Fp8x4ToHalf2x2<Fp8>(r[0], a[0], a[2]);
          Fp8x4ToHalf2x2<Fp8>(r[1], a[1], a[3]);
          Fp8x4ToHalf2x2<Fp8>(r[2], b[0], b[2]);
          Fp8x4ToHalf2x2<Fp8>(r[3], b[1], b[3]);
        }
      }
    }
  };
  auto issue_pv = [&]() {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int p = 0; p < kPages; ++p)
        WgmmaAcc<TM, 64, 0, kRows / 8>(o[h], va[h * kPages + p], WithStart(b_desc, p_addr + p * 2048));
  };

  // One tile: its Q.K, with the previous tile's P.V when kWithPv (the first tile has
  // none: a separate instantiation, so that no branch sits between products), then
  // the online softmax into m_run, l_run, o and P^T.
  auto tile_step = [&](int t, auto with_pv) {
    constexpr bool kWithPv = decltype(with_pv)::value;
    load_k(t);
    if constexpr (kWithPv) load_v(t - 1);
#pragma unroll
    for (int j = 0; j < kRows / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    KeepRegs(s);
    KeepRegs(o[0]);
    KeepRegs(o[1]);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      WgmmaAcc<TM, 64, 0, kRows / 8>(s, ka[kk], WithStart(b_desc, q_addr + kk * 2048));
    if constexpr (kWithPv) issue_pv();  // the previous tile's P^T, written before the last barrier
    WgmmaCommit();
    WgmmaWaitAll();
    KeepRegs(ka);
    KeepRegs(va);
    KeepRegs(s);
    KeepRegs(o[0]);
    KeepRegs(o[1]);

    // Online softmax over the tile's 64 tokens: this warp's 16 (its lanes' gid), then
    // the four warps' maxima through shared memory.
    float mx[kRows / 4];
#pragma unroll
    for (int c = 0; c < kRows / 4; ++c) {
      mx[c] = fmaxf(s[c / 2][c % 2], s[c / 2][2 + c % 2]) * scale_log2;
      mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], 4));
      mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], 8));
      mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], 16));
    }
    float* red_t = red + (t & 1) * kRows * 4;
    if (gid == 0) {
#pragma unroll
      for (int c = 0; c < kRows / 4; ++c) red_t[(8 * (c / 2) + 2 * tq + c % 2) * 4 + warp] = mx[c];
    }
    __syncthreads();
    float alpha[kRows / 4];
#pragma unroll
    for (int c = 0; c < kRows / 4; ++c) {
      const float4 w4 = reinterpret_cast<const float4*>(red_t)[8 * (c / 2) + 2 * tq + c % 2];
      const float m_new = fmaxf(m_run[c], fmaxf(fmaxf(w4.x, w4.y), fmaxf(w4.z, w4.w)));
      alpha[c] = exp2f(m_run[c] - m_new);
      m_run[c] = m_new;
      l_run[c] *= alpha[c];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < kRows / 8; ++j) {
        o[h][j][0] *= alpha[2 * j];
        o[h][j][1] *= alpha[2 * j + 1];
        o[h][j][2] *= alpha[2 * j];
        o[h][j][3] *= alpha[2 * j + 1];
      }
    // P^T: n-tiles j, j + 1 x token halves, as four transposed 8x8 matrices; matrix
    // (n-tile j + (sel >> 1), half sel & 1), row lane % 8: query row 8 (j + (sel >> 1)) +
    // lane % 8 at K chunk 2 warp + (sel & 1).
#pragma unroll
    for (int j = 0; j < kRows / 8; j += 2) {
      uint32_t pk[4];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float e[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          e[i] = exp2f(s[j + u][i] * scale_log2 - m_run[2 * (j + u) + (i & 1)]);
          l_run[2 * (j + u) + (i & 1)] += e[i];
        }
        pk[2 * u] = PackPair<TM>(e[0], e[1]);      // token gid
        pk[2 * u + 1] = PackPair<TM>(e[2], e[3]);  // token gid + 8
      }
      Stsm4T(p_addr + (2 * warp + (sel & 1)) * 1024 + (8 * (j + (sel >> 1)) + (lane & 7)) * 16,
             pk[0], pk[1], pk[2], pk[3]);
    }
    FenceProxyAsyncShared();  // P^T's generic stores, then the tensor cores' reads
    __syncthreads();
  };
  tile_step(0, std::false_type{});
  for (int t = 1; t < tiles; ++t) tile_step(t, std::true_type{});
  load_v(tiles - 1);
  KeepRegs(o[0]);
  KeepRegs(o[1]);
  WgmmaFence();
  issue_pv();
  WgmmaCommit();
  WgmmaWaitAll();
  KeepRegs(va);
  KeepRegs(o[0]);
  KeepRegs(o[1]);

  // The rows' sums: this warp's tokens, then the four warps' (parity 0's buffer: every
  // thread read the last tile's maxima before the last barrier).
#pragma unroll
  for (int c = 0; c < kRows / 4; ++c) {
    l_run[c] += __shfl_xor_sync(0xffffffffu, l_run[c], 4);
    l_run[c] += __shfl_xor_sync(0xffffffffu, l_run[c], 8);
    l_run[c] += __shfl_xor_sync(0xffffffffu, l_run[c], 16);
  }
  if (gid == 0) {
#pragma unroll
    for (int c = 0; c < kRows / 4; ++c) red[(8 * (c / 2) + 2 * tq + c % 2) * 4 + warp] = l_run[c];
  }
  __syncthreads();
  float* o_out = out + static_cast<size_t>(blockIdx.x) * kRows * kD;
#pragma unroll
  for (int c = 0; c < kRows / 4; ++c) {
    const int row = 8 * (c / 2) + 2 * tq + c % 2;
    const float4 w4 = reinterpret_cast<const float4*>(red)[row];
    const float inv = 1.0f / (w4.x + w4.y + w4.z + w4.w);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int dim = 64 * h + 16 * warp + gid;
      o_out[row * kD + dim] = o[h][c / 2][c % 2] * inv;
      o_out[row * kD + dim + 8] = o[h][c / 2][2 + c % 2] * inv;
    }
  }
}

// Form 4: fp8 products on the fp8 pages as they are.
// S = Q K^T and O += P V as wgmma m64nNk32 .e4m3.e4m3 products (twice the 16-bit
// rate), nothing widened; each 16-bit operand (the query rows, P) is split into
// two e4m3 terms, hi = its value with the mantissa cut to 3 bits (exact in e4m3)
// and lo = the rest (rounded), both multiplied into the same accumulators: two
// fp8 products cost one 16-bit product's time, and hi + lo carries about 8
// significant bits (a bf16 query exactly), where the mma.sync row split and the
// fp8 rows above widen every K and V value to f16 for the f16 products.
//   Query rows: times a power of two per row (amax in [128, 256), divided out of
//   the logits), split once per CTA into A fragments (8-bit layout: lane tq holds
//   bytes 4 tq .. 4 tq + 3 of each 16-element K half).
//   P: exp2(l - max + 8), i.e. 256 times the probabilities (range [0, 256], e4m3
//   max 448), split per tile. Its A fragment needs lane tq's tokens 4 tq .. 4 tq +
//   3 of a page, and S's accumulators give lane tq columns 2 tq, 2 tq + 1 of each
//   8-token n-tile: the K pages' token rows are stored permuted (PermKRow, as a
//   tensor map could write them), so that those columns are these tokens.
//   K: K-major B operand, core matrix 8 tokens x 16 dims (LBO 256: the next 16
//   dims; SBO a page: Q.K as m64n32k32 across the tile's four pages, form 1's
//   n32). V: its [D][16] rows as they are, core matrix 8 dims x 16 tokens (LBO a
//   page: the next 16 tokens; SBO 128), two m64n64k32 per page pair and term.
constexpr int kSplitSmemBytes = kStages * kFp8StageBytes;  // 32 KB

// (The e4m3 products, the operand split and the quad gather are defined at the top
// of this file. Form 4b gathers P's A registers across each lane quad instead of
// storing K's token rows permuted.)
// Accuracy variants (form 4b's arithmetic otherwise): the
// e4m3 tensor-core products accumulate with fewer bits than fp32 (about 14 on
// Hopper, DeepSeek-V3's report), so the kernel's logits, one chain of 8 products
// per S half, and its O, one chain over every tile, are less exact than the split
// operands. kQk 1: the hi terms and the lo terms in two chains, added in fp32;
// kQk 2: each Q.K product into a fresh accumulator, waited for and added in fp32
// (no tensor-core accumulation across products: the most exact logits, and the
// waits' cost). kPvFresh: each tile's P.V into fresh accumulators (its four
// products chained), added to O in fp32 (DeepSeek-V3's promotion; 64 more
// registers). Every split form also writes its rows' lse (natural log) after the
// outputs: out[gridDim.x * kRows * kD + item * kRows + row].
template <bool kFirst, typename A, typename B>
__device__ __forceinline__ auto& Pick(A& a, B& b) {  // a if kFirst, else b
  if constexpr (kFirst)
    return a;
  else
    return b;
}
template <bool kPermK, int kQk = 0, bool kPvFresh = false>
__global__ void __launch_bounds__(128, 2)
    SplitLoop(const void* __restrict__ k_glob, const void* __restrict__ v_glob,
              const uint16_t* __restrict__ q_glob, float* __restrict__ out, int tiles,
              float scale_log2) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int gid = lane >> 2;
  const int tq = lane & 3;
  const int row0 = 16 * warp + gid;  // this thread's rows: row0, row0 + 8

  FillStages<true, kPermK>(smem, k_glob, v_glob);
  FenceProxyAsyncShared();  // generic stores, then the tensor cores' reads
  __syncthreads();

  // The query rows (f16), scaled per row and split: k step ks, register j: row
  // row0 + 8 (j & 1), dims 32 ks + 16 (j >> 1) + 4 tq + (0..3).
  auto q_at = [&](int j, int ks, int e) {
    const int d = 32 * ks + 16 * (j >> 1) + 4 * tq + e;
    return __half2float(__ushort_as_half(q_glob[(row0 + 8 * (j & 1)) * kD + d]));
  };
  float amax[2] = {0.0f, 0.0f};
#pragma unroll
  for (int ks = 0; ks < kD / 32; ++ks)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) amax[j & 1] = fmaxf(amax[j & 1], fabsf(q_at(j, ks, e)));
  float qs[2], row_scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 1));
    amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 2));
    int e = 0;
    (void)frexpf(amax[r], &e);  // amax < 2^e
    qs[r] = amax[r] > 0.0f ? ldexpf(1.0f, 8 - e) : 1.0f;  // amax * qs in [128, 256)
    row_scale[r] = scale_log2 / qs[r];                   // logits (log2 units) per row
  }
  uint32_t qhi[kD / 32][4], qlo[kD / 32][4];
#pragma unroll
  for (int ks = 0; ks < kD / 32; ++ks)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = q_at(j, ks, e) * qs[j & 1];
      SplitE4m3x4(v, qhi[ks][j], qlo[ks][j]);
    }

  const uint32_t smem0 = SmemAddr(smem);
  const uint64_t k_desc = SmemDescriptor(16u * kBS, kFp8PageBytes, SmemSwizzle::kNone);
  const uint64_t v_desc = SmemDescriptor(kFp8PageBytes, 128u, SmemSwizzle::kNone);

  float o[kNT][4];
#pragma unroll
  for (int n = 0; n < kNT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  float s[kPages][2][4];
#pragma unroll
  for (int p = 0; p < kPages; ++p)
#pragma unroll
    for (int h = 0; h < 2; ++h) s[p][h][0] = s[p][h][1] = s[p][h][2] = s[p][h][3] = 0.0f;
  // kQk 1: the lo terms' chain; kQk 2: one product's fresh accumulators.
  float s_aux[kQk != 0 ? kPages : 1][2][4];
  // kPvFresh: the P.V products of one tile (added to O once they are done).
  float o_tile[kPvFresh ? kNT : 1][4];
  uint32_t pa_hi[kPages / 2][4], pa_lo[kPages / 2][4];  // P of the previous tile, per page pair
  int prev_tile = -1;

  auto issue_pv = [&]() {
    const uint32_t vbase = smem0 + (prev_tile & 1) * kFp8StageBytes + kPages * kFp8PageBytes;
    auto& acc = Pick<kPvFresh>(o_tile, o);
#pragma unroll
    for (int pp = 0; pp < kPages / 2; ++pp) {
      const uint32_t page = vbase + 2 * pp * kFp8PageBytes;
      if (kPvFresh && pp == 0) {  // a fresh chain per tile
        WgmmaE4m3AccN64<0, kNT, false>(acc, pa_hi[pp], WithStart(v_desc, page));
        WgmmaE4m3AccN64<8, kNT, false>(acc, pa_hi[pp], WithStart(v_desc, page + 64 * 16));
      } else {
        WgmmaE4m3AccN64<0>(acc, pa_hi[pp], WithStart(v_desc, page));
        WgmmaE4m3AccN64<8>(acc, pa_hi[pp], WithStart(v_desc, page + 64 * 16));
      }
      WgmmaE4m3AccN64<0>(acc, pa_lo[pp], WithStart(v_desc, page));
      WgmmaE4m3AccN64<8>(acc, pa_lo[pp], WithStart(v_desc, page + 64 * 16));
    }
  };
  auto add_pv = [&]() {  // kPvFresh: O += the finished tile's P.V, in fp32
    if constexpr (kPvFresh) {
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] += o_tile[n][i];
    }
  };
  auto add_aux = [&](int h) {  // s[.][h] += s_aux[.][h], in fp32
#pragma unroll
    for (int p = 0; p < kPages; ++p)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[p][h][i] += s_aux[p][h][i];
  };

  auto tile_step = [&](int t, auto with_pv) {
    constexpr bool kWithPv = decltype(with_pv)::value;
    const uint32_t kbase = smem0 + (t & 1) * kFp8StageBytes;
    WgmmaFence();
    if constexpr (kQk == 2) {
      // The P.V first, then each product alone: issue, wait, add in fp32.
      if constexpr (kWithPv) {
        issue_pv();
        WgmmaCommit();
      }
#pragma unroll
      for (int p = 0; p < kPages; ++p)
#pragma unroll
        for (int h = 0; h < 2; ++h) s[p][h][0] = s[p][h][1] = s[p][h][2] = s[p][h][3] = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int ks = 0; ks < kD / 32; ++ks)
#pragma unroll
          for (int term = 0; term < 2; ++term) {
            const uint64_t desc = WithStart(k_desc, kbase + h * 128 + ks * 512);
            WgmmaFence();
            WgmmaE4m3N32<false>(s_aux[0][h], s_aux[1][h], s_aux[2][h], s_aux[3][h],
                                term ? qlo[ks] : qhi[ks], desc);
            WgmmaCommit();
            WgmmaWaitAll();
            add_aux(h);
          }
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // smem rows 8 h .. 8 h + 7 of every page's chunks
#pragma unroll
        for (int ks = 0; ks < kD / 32; ++ks) {
          const uint64_t desc = WithStart(k_desc, kbase + h * 128 + ks * 512);
          auto& lo = Pick<kQk == 1>(s_aux, s);
          if (ks == 0) {
            WgmmaE4m3N32<false>(s[0][h], s[1][h], s[2][h], s[3][h], qhi[ks], desc);
            WgmmaE4m3N32<kQk != 1>(lo[0][h], lo[1][h], lo[2][h], lo[3][h], qlo[ks], desc);
          } else {
            WgmmaE4m3N32<true>(s[0][h], s[1][h], s[2][h], s[3][h], qhi[ks], desc);
            WgmmaE4m3N32<true>(lo[0][h], lo[1][h], lo[2][h], lo[3][h], qlo[ks], desc);
          }
        }
      }
      if constexpr (kWithPv) issue_pv();
      WgmmaCommit();
      WgmmaWaitAll();
      if constexpr (kQk == 1) {
        add_aux(0);
        add_aux(1);
      }
    }
    if constexpr (kWithPv) add_pv();

    RescaleRows(s, row_scale, m_run, l_run, o);
    const float (&mx)[2] = m_run;
    // 256 x P; lane tq's tokens of page p: 4 tq + 2 h + i = S's s[p][h][i] (row0) and
    // s[p][h][2 + i] (row0 + 8), see PermKRow (or, kPermK false, tokens 8 h + 2 tq + i,
    // gathered by QuadGatherBytes).
    const float bias[2] = {8.0f - mx[0], 8.0f - mx[1]};
#pragma unroll
    for (int pp = 0; pp < kPages / 2; ++pp)
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // A register j: row row0 + 8 (j & 1), page 2 pp + (j >> 1)
        const int p = 2 * pp + (j >> 1), r = j & 1;
        float e[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          e[k] = exp2f(fmaf(s[p][k >> 1][2 * r + (k & 1)], row_scale[r], bias[r]));
          l_run[r] += e[k];
        }
        SplitE4m3x4(e, pa_hi[pp][j], pa_lo[pp][j]);
        if constexpr (!kPermK) {
          pa_hi[pp][j] = QuadGatherBytes(pa_hi[pp][j], lane);
          pa_lo[pp][j] = QuadGatherBytes(pa_lo[pp][j], lane);
        }
      }
    prev_tile = t;
  };
  tile_step(0, std::false_type{});
  for (int t = 1; t < tiles; ++t) tile_step(t, std::true_type{});
  WgmmaFence();  // the last tile's P.V
  issue_pv();
  WgmmaCommit();
  WgmmaWaitAll();
  add_pv();
  QuadSums(l_run);
  WriteRows(o, l_run, out + static_cast<size_t>(blockIdx.x) * kRows * kD, row0, tq);
  if (tq == 0) {  // lse: the logits' units are log2, and l_run sums 256 P (the bias 8)
    float* lse = out + static_cast<size_t>(gridDim.x) * kRows * kD + blockIdx.x * kRows;
#pragma unroll
    for (int r = 0; r < 2; ++r)
      lse[row0 + 8 * r] = (m_run[r] + log2f(l_run[r]) - 8.0f) * 0.6931471805599453f;
  }
}

// One set of pages and query rows, on the host and on the device.
struct Data {
  bool fp8 = false;                       // e4m3 pages and an f16 query (else bf16 both)
  std::vector<unsigned char> k, v;        // device layouts (see TileLoop)
  std::vector<uint16_t> q;                // [kRows][kD], bf16 or f16 bits
  std::vector<float> kf, vf, qf;          // the same values as float: kf[st][tok][d], vf likewise, qf[r][d]
  void *k_dev = nullptr, *v_dev = nullptr;
  uint16_t* q_dev = nullptr;
};

template <typename U>
uint16_t Bits16(U x) {
  uint16_t b;
  std::memcpy(&b, &x, 2);
  return b;
}

Data MakeData(uint32_t seed, bool fp8) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Data x;
  x.fp8 = fp8;
  const int toks = kStages * kTile;
  const int elem = fp8 ? 1 : 2;  // bytes per cache value
  x.kf.resize(toks * kD);
  x.vf.resize(toks * kD);
  x.qf.resize(kRows * kD);
  x.k.resize(static_cast<size_t>(toks) * kD * elem);
  x.v.resize(static_cast<size_t>(toks) * kD * elem);
  x.q.resize(kRows * kD);
  // Values as the device holds them: bf16, or e4m3 (the cache) and f16 (the query).
  auto cache_value = [&](float f) {
    return fp8 ? static_cast<float>(Fp8(f)) : __bfloat162float(__float2bfloat16(f));
  };
  for (auto& f : x.kf) f = cache_value(nd(gen));
  for (auto& f : x.vf) f = cache_value(nd(gen));
  for (auto& f : x.qf) f = fp8 ? __half2float(__float2half(nd(gen))) : __bfloat162float(__float2bfloat16(nd(gen)));
  auto put = [&](std::vector<unsigned char>& dst, size_t index, float f) {
    if (fp8) {
      const Fp8 v(f);
      std::memcpy(&dst[index], &v, 1);
    } else {
      const uint16_t b = Bits16(__float2bfloat16(f));
      std::memcpy(&dst[2 * index], &b, 2);
    }
  };
  // K: [D/x][16][x] per page (x = 8 bf16, 16 fp8 values: 16 bytes); V: [D][16].
  const int x_per = fp8 ? 16 : 8;
  for (int st = 0; st < kStages; ++st)
    for (int p = 0; p < kPages; ++p)
      for (int t = 0; t < kBS; ++t)
        for (int d = 0; d < kD; ++d) {
          const int tok = st * kTile + p * kBS + t;
          const size_t page = static_cast<size_t>(st * kPages + p) * kD * kBS;
          put(x.k, page + ((d / x_per) * kBS + t) * x_per + d % x_per, x.kf[tok * kD + d]);
          put(x.v, page + d * kBS + t, x.vf[tok * kD + d]);
        }
  for (int i = 0; i < kRows * kD; ++i)
    x.q[i] = fp8 ? Bits16(__float2half(x.qf[i])) : Bits16(__float2bfloat16(x.qf[i]));
  CUDA_OK(cudaMalloc(&x.k_dev, x.k.size()));
  CUDA_OK(cudaMalloc(&x.v_dev, x.v.size()));
  CUDA_OK(cudaMalloc(&x.q_dev, x.q.size() * 2));
  CUDA_OK(cudaMemcpy(x.k_dev, x.k.data(), x.k.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(x.v_dev, x.v.data(), x.v.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(x.q_dev, x.q.data(), x.q.size() * 2, cudaMemcpyHostToDevice));
  return x;
}

void FreeData(Data& x) {
  CUDA_OK(cudaFree(x.k_dev));
  CUDA_OK(cudaFree(x.v_dev));
  CUDA_OK(cudaFree(x.q_dev));
}

// The rows' outputs ([kRows][kD]), then their lse ([kRows], natural log).
std::vector<double> Reference(const Data& x, int tiles, double scale) {
  std::vector<double> out(kRows * kD + kRows, 0.0);
  for (int r = 0; r < kRows; ++r) {
    std::vector<double> logit(tiles * kTile);
    double mx = -INFINITY;
    for (int t = 0; t < tiles; ++t)
      for (int j = 0; j < kTile; ++j) {
        const int tok = (t % kStages) * kTile + j;
        double acc = 0.0;
        for (int d = 0; d < kD; ++d) acc += double(x.qf[r * kD + d]) * x.kf[tok * kD + d];
        logit[t * kTile + j] = acc * scale;
        mx = std::max(mx, logit[t * kTile + j]);
      }
    double sum = 0.0;
    for (auto& l : logit) sum += (l = std::exp(l - mx));
    out[kRows * kD + r] = mx + std::log(sum);
    for (int t = 0; t < tiles; ++t)
      for (int j = 0; j < kTile; ++j) {
        const int tok = (t % kStages) * kTile + j;
        for (int d = 0; d < kD; ++d) out[r * kD + d] += logit[t * kTile + j] / sum * x.vf[tok * kD + d];
      }
  }
  return out;
}

// A form as the host launches it: its kernel, threads per CTA, its own dynamic
// shared memory, its name in the checks, and which data set it reads.
using KernelFn = void (*)(const void*, const void*, const uint16_t*, float*, int, float);
struct Form {
  KernelFn kernel;
  int threads;
  int smem;
  std::string name;
  bool fp8;
  bool lse = false;  // writes its rows' lse after the outputs (the split forms)
};
template <int kWgs, bool kN32, int kFp8 = 0>
Form TileForm() {
  return {TileLoop<kWgs, kN32, kFp8>, 128 * kWgs, kFp8 ? kFp8SmemBytes : kSmemBytes,
          "form " + std::to_string(kWgs) + (kN32 ? " n32" : "") +
              (kFp8 == 1 ? " fp8" : (kFp8 == 2 ? " fp8 ahead" : "")),
          kFp8 != 0};
}
template <bool kPermK, int kQk = 0, bool kPvFresh = false>
Form SplitForm() {
  return {SplitLoop<kPermK, kQk, kPvFresh>, 128, kSplitSmemBytes,
          std::string("form 4") + (kPermK ? "" : "b") + " (fp8 products, split)" +
              (kQk == 1 ? ", Q.K hi/lo chains" : (kQk == 2 ? ", Q.K fresh per product" : "")) +
              (kPvFresh ? ", P.V fresh per tile" : ""),
          true, true};
}
template <int kFp8>
Form SwapForm() {
  return {SwapLoop<kFp8>, 128, SwapSmem(kFp8), std::string("form 3 (swap)") + (kFp8 ? " fp8" : ""),
          kFp8 != 0};
}

// smem: the dynamic shared memory asked for (>= the form's own; -1: its own); more
// than the stages need limits the CTAs per SM, as the grouped kernel's larger stages do.
void Launch(const Form& f, int items, const Data& x, float* out, int tiles, float scale_log2,
            int smem) {
  f.kernel<<<items, f.threads, smem < 0 ? f.smem : smem>>>(x.k_dev, x.v_dev, x.q_dev, out, tiles,
                                                           scale_log2);
}

int CtasPerSm(const Form& f, int smem = -1) {
  int n = 0;
  CUDA_OK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, f.kernel, f.threads,
                                                        smem < 0 ? f.smem : smem));
  return n;
}

// The float64 result of a data set over `tiles` tiles, computed once.
const std::vector<double>& CachedReference(const Data& x, int tiles, double scale) {
  static std::map<std::pair<const Data*, int>, std::vector<double>> cache;
  auto it = cache.find({&x, tiles});
  if (it == cache.end()) it = cache.emplace(std::make_pair(&x, tiles), Reference(x, tiles, scale)).first;
  return it->second;
}

// gate false: a measurement (the long chains' error), printed, not a pass/fail check.
bool Check(const Form& f, const Data& x, float* out, int tiles, bool gate = true) {
  const double scale = 1.0 / std::sqrt(double(kD));
  const int items = 2;
  // NaN: unwritten outputs (and lse).
  CUDA_OK(cudaMemset(out, 0xFF, sizeof(float) * items * kRows * (kD + 1)));
  Launch(f, items, x, out, tiles, static_cast<float>(scale * 1.4426950408889634), -1);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got(items * kRows * (kD + 1));
  CUDA_OK(cudaMemcpy(got.data(), out, sizeof(float) * got.size(), cudaMemcpyDeviceToHost));
  const std::vector<double>& ref = CachedReference(x, tiles, scale);
  double err2 = 0.0, ref2 = 0.0, max_err = 0.0, lse_err = 0.0;
  bool finite = true;
  for (int it = 0; it < items; ++it) {
    for (int i = 0; i < kRows * kD; ++i) {
      const double g = got[it * kRows * kD + i];
      finite = finite && std::isfinite(g);
      err2 += (g - ref[i]) * (g - ref[i]);
      ref2 += ref[i] * ref[i];
      max_err = std::max(max_err, std::fabs(g - ref[i]));
    }
    for (int r = 0; f.lse && r < kRows; ++r) {
      const double g = got[items * kRows * kD + it * kRows + r];
      finite = finite && std::isfinite(g);
      lse_err = std::max(lse_err, std::fabs(g - ref[kRows * kD + r]));
    }
  }
  const double rel = std::sqrt(err2 / ref2);
  // bf16 (f16) P against float64 on the exact page values: the benchmark's bf16 bound, 1e-2.
  const bool ok = finite && rel < 1e-2;
  char lse_text[48] = "";
  if (f.lse) std::snprintf(lse_text, sizeof(lse_text), ", max |lse err| %.2e", lse_err);
  std::printf("%s %s, %d tiles: rel L2 err %.2e, max |err| %.2e%s: %s\n", gate ? "check" : "chain",
              f.name.c_str(), tiles, rel, max_err, lse_text,
              gate ? (ok ? "ok" : "WRONG") : (ok ? "under 1e-2" : "over 1e-2"));
  return ok || !gate;
}

double TimeUs(const Form& f, const Data& x, float* out, int items, int tiles, int smem = -1) {
  const float scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(double(kD)));
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) Launch(f, items, x, out, tiles, scale_log2, smem);
  CUDA_OK(cudaGetLastError());
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    CUDA_OK(cudaEventRecord(a));
    Launch(f, items, x, out, tiles, scale_log2, smem);
    CUDA_OK(cudaEventRecord(b));
    CUDA_OK(cudaEventSynchronize(b));
    float t = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CUDA_OK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  return 1e3 * ms[ms.size() / 2];
}

}  // namespace

int main() {
  int dev = 0;
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs, compute capability %d.%d\n", prop.name, prop.multiProcessorCount,
              prop.major, prop.minor);
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("needs compute capability 9.0 (sm_90a code): skipped\n");
    return 0;
  }
  // (kTwoPerSm: the stages of the grouped kernel's 64-row CTAs, three of 32 KB and their
  // extras, which leave two CTAs per SM.)
  constexpr int kTwoPerSm = 100 * 1024;
  const Form n16 = TileForm<1, false>(), pp16 = TileForm<2, false>(), n32 = TileForm<1, true>(),
             pp32 = TileForm<2, true>(), fp8_start = TileForm<1, true, 1>(),
             fp8_ahead = TileForm<1, true, 2>(), swap = SwapForm<0>(), swap8 = SwapForm<1>(),
             split = SplitForm<true>(), split_gather = SplitForm<false>(),
             gather_chains = SplitForm<false, 1>(), gather_fresh = SplitForm<false, 2>(),
             gather_pv = SplitForm<false, 0, true>(), gather_both = SplitForm<false, 1, true>();
  const Form* forms[] = {&n16,       &pp16,         &n32,          &pp32,         &fp8_start,
                         &fp8_ahead, &swap,         &swap8,        &split,        &split_gather,
                         &gather_chains, &gather_fresh, &gather_pv, &gather_both};
  for (const Form* f : forms)
    CUDA_OK(cudaFuncSetAttribute(f->kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 std::max(f->smem, kTwoPerSm)));
  Data x = MakeData(1234u, false);
  Data x8 = MakeData(4321u, true);
  float* out;
  const int items = 512, tiles = 64;  // 64 x 32 x 8 x 4096 at q_len 16: 512 (sequence, KV head) items
  CUDA_OK(cudaMalloc(&out, sizeof(float) * items * kRows * (kD + 1)));

  bool ok = true;
  for (int t : {1, 2, 5})
    for (const Form* f : forms) ok = Check(*f, f->fp8 ? x8 : x, out, t) && ok;
  // The error over long chains (64 tiles: 4096 tokens, the timed rows' length; 512:
  // 32768), measured, not gated: the fp8 products' accumulation against fp32's.
  for (int t : {64, 512})
    for (const Form* f : {&n32, &fp8_ahead, &split_gather, &gather_chains, &gather_fresh, &gather_pv,
                          &gather_both})
      Check(*f, f->fp8 ? x8 : x, out, t, false);
  const double gflop = 4.0 * kRows * kD * double(kTile) * tiles * items / 1e9;
  std::printf("work: %d items x %d tiles of %d tokens, %d rows, head %d: %.1f GFLOP\n", items, tiles,
              kTile, kRows, kD, gflop);
  auto report = [&](const char* name, const Form& f, int smem = -1) {
    const double us = TimeUs(f, f.fp8 ? x8 : x, out, items, tiles, smem);
    std::printf("%-58s %d/SM %8.1f us  %6.1f TFLOP/s\n", name, CtasPerSm(f, smem), us,
                gflop / us * 1e3);
  };
  report("form 1 (one warpgroup per CTA), Q.K m64n16k16 per page:", n16);
  report("form 2 (two warpgroups, ping-pong), m64n16k16:", pp16);
  report("form 1, Q.K m64n32k16 across the pages:", n32);
  report("form 1, m64n32k16, 100 KB of shared memory per CTA:", n32, kTwoPerSm);
  report("form 2, m64n32k16:", pp32);
  report("form 1, m64n32k16, fp8 pages widened at each tile's start:", fp8_start);
  report("form 1, m64n32k16, fp8 pages widened one tile ahead:", fp8_ahead);
  report("form 3 (K, V as A from registers), m64n64k16, bf16:", swap);
  report("form 3, fp8 pages widened in registers:", swap8);
  report("form 3, fp8, 100 KB of shared memory per CTA:", swap8, kTwoPerSm);
  report("form 4 (e4m3 products, 16-bit operands split in two):", split);
  report("form 4, 100 KB of shared memory per CTA:", split, kTwoPerSm);
  report("form 4b (K as it is, P gathered by shuffles), 100 KB:", split_gather, kTwoPerSm);
  report("form 4b, Q.K hi and lo terms in two chains, 100 KB:", gather_chains, kTwoPerSm);
  report("form 4b, Q.K fresh per product (waits), 100 KB:", gather_fresh, kTwoPerSm);
  report("form 4b, P.V fresh per tile, added in fp32, 100 KB:", gather_pv, kTwoPerSm);
  report("form 4b, two Q.K chains and P.V fresh per tile, 100 KB:", gather_both, kTwoPerSm);
  std::printf("compare: the grouped kernel's arithmetic alone on the same work (a build with\n"
              "-DJAX_PAGED_PROBE_NO_LOADS=ON, 64,32,8,4096 --q-len 16 and --fp8-q-len 16; the\n"
              "measured figures are in docs/development.md); the fp8 rows against the bf16 row at\n"
              "100 KB (both two CTAs per SM): what widening once per CTA costs the wgmma arithmetic\n");
  FreeData(x);
  FreeData(x8);
  CUDA_OK(cudaFree(out));
  return ok ? 0 : 1;
}
