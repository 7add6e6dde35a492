// Standalone GPU check of the portable grouped decode kernel (csrc/cuda/sm80/):
// random caches and block tables (-1 padding, NaN in every slot no row attends,
// an invalid block id inside one sequence), the launcher run over a grid of
// cases, each compared with a naive host reference in double precision that
// follows jax_paged/reference.py (the V1 form: the split's merge differs from it
// by the 1e-6 terms only). Prints the largest errors per case and PASS / FAIL;
// exits 1 on any failure.
//
// Build (from the repository root; the instance units compile in parallel):
//   mkdir -p /tmp/sm80o && for f in csrc/cuda/instances/sm80_*.cu dev/sm80_check.cu; do nvcc -std=c++17 --expt-relaxed-constexpr -O3 -Icsrc -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 -c $f -o /tmp/sm80o/$(basename $f).o & done; wait; nvcc -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 /tmp/sm80o/*.o -o /tmp/sm80_check && /tmp/sm80_check
//
// `sm80_check --bench` instead times a few large decode calls and reports their
// K/V bytes per second against a plain read of the same bytes on the same GPU.
//
// Tolerances: on out, |out - ref| / max(1, |ref|); on the LSE, absolute. The
// products round P to the product type (bf16: 8 significant bits, f16: 11) and
// the output is rounded to the query dtype.
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
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/sm80/launch.h"
#include "params.h"

using jax_paged::PagedAttentionParams;

namespace {

constexpr double kTolBf16 = 1e-2;
constexpr double kTolF16 = 5e-3;
constexpr double kTolFp8 = 2e-2;  // (bf16 queries on fp8 caches: P in f16, output in bf16)
constexpr double kTolLse = 2e-3;

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,                  \
                   cudaGetErrorString(e_));                                            \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

enum class QK { kBf16, kF16 };
enum class CK { kSame, kE4m3, kE5m2 };

struct Case {
  QK q = QK::kBf16;
  CK c = CK::kSame;
  int d = 128;
  int bs = 16;
  std::vector<int> lens;
  int kv_heads = 2;
  int group = 4;
  int q_len = 1;
  int ps = 64;         // partition_size; 0: one partition over the table
  int window = 0;
  float cap = 0.0f;
  bool alibi = false;
  bool lse = true;
  bool scales = false;      // k_scale / v_scale per KV head (else none)
  bool invalid_page = false;  // an out-of-range block id inside the longest sequence
  std::string name;
};

// Storage helpers: 16-bit values and fp8 bytes from floats, and back.
uint16_t ToBits(float v, QK k) {
  if (k == QK::kBf16) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    uint16_t u;
    std::memcpy(&u, &b, 2);
    return u;
  }
  __half h = __float2half_rn(v);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
double FromBits(uint16_t u, QK k) {
  if (k == QK::kBf16) {
    __nv_bfloat16 b;
    std::memcpy(&b, &u, 2);
    return static_cast<double>(__bfloat162float(b));
  }
  __half h;
  std::memcpy(&h, &u, 2);
  return static_cast<double>(__half2float(h));
}
uint8_t ToFp8(float v, CK k) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, k == CK::kE4m3 ? __NV_E4M3 : __NV_E5M2);
}
double FromFp8(uint8_t b, CK k) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(b, k == CK::kE4m3 ? __NV_E4M3 : __NV_E5M2);
  __half hh(h);
  return static_cast<double>(__half2float(hh));
}

template <typename T, typename TC>
cudaError_t LaunchFor(int d, const PagedAttentionParams& p) {
  using jax_paged::cuda::sm80::LaunchPortableGroupedAttention;
  constexpr bool kFp8 = sizeof(TC) == 1;
  switch (d) {
    case 64: return LaunchPortableGroupedAttention<T, TC, 64>(p, 0, 0);
    case 80: return LaunchPortableGroupedAttention<T, TC, 80>(p, 0, 0);
    case 96: return LaunchPortableGroupedAttention<T, TC, 96>(p, 0, 0);
    case 112: return LaunchPortableGroupedAttention<T, TC, 112>(p, 0, 0);
    case 120:
      if constexpr (!kFp8) return LaunchPortableGroupedAttention<T, TC, 120>(p, 0, 0);
      return cudaErrorInvalidValue;
    case 128: return LaunchPortableGroupedAttention<T, TC, 128>(p, 0, 0);
    case 192: return LaunchPortableGroupedAttention<T, TC, 192>(p, 0, 0);
    case 256: return LaunchPortableGroupedAttention<T, TC, 256>(p, 0, 0);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t Launch(const Case& c, const PagedAttentionParams& p) {
  if (c.q == QK::kBf16) {
    switch (c.c) {
      case CK::kSame: return LaunchFor<__nv_bfloat16, __nv_bfloat16>(c.d, p);
      case CK::kE4m3: return LaunchFor<__nv_bfloat16, __nv_fp8_e4m3>(c.d, p);
      case CK::kE5m2: return LaunchFor<__nv_bfloat16, __nv_fp8_e5m2>(c.d, p);
    }
  } else {
    switch (c.c) {
      case CK::kSame: return LaunchFor<__half, __half>(c.d, p);
      case CK::kE4m3: return LaunchFor<__half, __nv_fp8_e4m3>(c.d, p);
      case CK::kE5m2: return LaunchFor<__half, __nv_fp8_e5m2>(c.d, p);
    }
  }
  return cudaErrorInvalidValue;
}

template <typename V>
V* ToDevice(const std::vector<V>& h) {
  V* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(V)));
  if (!h.empty()) CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(V), cudaMemcpyHostToDevice));
  return d;
}

// Runs one case; returns true when it passes.
bool RunCase(const Case& c, std::mt19937& rng) {
  const bool fp8 = c.c != CK::kSame;
  const int D = c.d, BS = c.bs, Hkv = c.kv_heads, G = c.group, H = Hkv * G, QL = c.q_len;
  const int S = static_cast<int>(c.lens.size());
  int max_len = 1;
  for (int l : c.lens) max_len = std::max(max_len, l);
  const int max_blocks = (max_len + BS - 1) / BS + 1;  // one padding entry at least
  const int capacity = max_blocks * BS;
  const int ps = c.ps > 0 ? c.ps : capacity;
  const int P = (capacity + ps - 1) / ps;
  int used_blocks = 0;
  for (int l : c.lens) used_blocks += (l + BS - 1) / BS;
  const int num_blocks = used_blocks + 3;  // a few never referenced (NaN)
  const int x = fp8 ? 16 : 8;

  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  // Block tables: a random permutation of the blocks, -1 padding.
  std::vector<int> perm(num_blocks);
  for (int i = 0; i < num_blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(static_cast<size_t>(S) * max_blocks, -1);
  int next = 0;
  int longest = 0;
  for (int s = 0; s < S; ++s) {
    if (c.lens[s] > c.lens[longest]) longest = s;
    for (int b = 0; b < (c.lens[s] + BS - 1) / BS; ++b) table[s * max_blocks + b] = perm[next++];
  }
  if (c.invalid_page && (c.lens[longest] + BS - 1) / BS >= 3)
    table[longest * max_blocks + 1] = num_blocks + 7;  // masked, never read
  // Caches: values where some sequence's token lives, NaN elsewhere.
  const size_t page = static_cast<size_t>(D) * BS;
  const size_t cache_elems = static_cast<size_t>(num_blocks) * Hkv * page;
  std::vector<double> kval(cache_elems, std::nan("")), vval(cache_elems, std::nan(""));
  std::vector<uint16_t> k16(cache_elems, 0x7FC0), v16(cache_elems, 0x7FC0);
  if (c.q == QK::kF16) {
    std::fill(k16.begin(), k16.end(), 0x7E00);
    std::fill(v16.begin(), v16.end(), 0x7E00);
  }
  std::vector<uint8_t> k8(cache_elems, 0x7F), v8(cache_elems, 0x7F);
  const float kmag = fp8 ? (c.c == CK::kE4m3 ? 4.0f : 2.0f) : 1.0f;
  auto kidx = [&](int blk, int h, int t, int d) -> size_t {  // [blk][h][D/x][BS][x]
    return ((static_cast<size_t>(blk) * Hkv + h) * (D / x) + d / x) * BS * x + t * x + d % x;
  };
  auto vidx = [&](int blk, int h, int t, int d) -> size_t {  // [blk][h][D][BS]
    return ((static_cast<size_t>(blk) * Hkv + h) * D + d) * BS + t;
  };
  for (int s = 0; s < S; ++s)
    for (int b = 0; b * BS < c.lens[s]; ++b) {
      const int blk = table[s * max_blocks + b];
      if (blk < 0 || blk >= num_blocks) continue;
      for (int h = 0; h < Hkv; ++h)
        for (int t = 0; t < BS && b * BS + t < c.lens[s]; ++t)
          for (int d = 0; d < D; ++d) {
            const float kv = uni(rng) * kmag, vv = uni(rng) * kmag;
            const size_t ki = kidx(blk, h, t, d), vi = vidx(blk, h, t, d);
            if (fp8) {
              k8[ki] = ToFp8(kv, c.c);
              v8[vi] = ToFp8(vv, c.c);
              kval[ki] = FromFp8(k8[ki], c.c);
              vval[vi] = FromFp8(v8[vi], c.c);
            } else {
              k16[ki] = ToBits(kv, c.q);
              v16[vi] = ToBits(vv, c.q);
              kval[ki] = FromBits(k16[ki], c.q);
              vval[vi] = FromBits(v16[vi], c.q);
            }
          }
    }
  const size_t qrows = static_cast<size_t>(S) * QL * H;
  std::vector<uint16_t> q16(qrows * D);
  std::vector<double> qv(qrows * D);
  const float qmag = c.cap > 0.0f ? 8.0f : 2.0f;  // larger logits where the cap bites
  for (size_t i = 0; i < q16.size(); ++i) {
    q16[i] = ToBits(uni(rng) * qmag, c.q);
    qv[i] = FromBits(q16[i], c.q);
  }
  std::vector<float> slopes(H), ksc(Hkv), vsc(Hkv);
  for (int h = 0; h < H; ++h) slopes[h] = std::ldexp(1.0f, -(h % 8) - 1);
  for (int h = 0; h < Hkv; ++h) {
    ksc[h] = c.scales ? 0.5f + 0.25f * h : 1.0f;
    vsc[h] = c.scales ? 1.5f - 0.25f * h : 1.0f;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  // Host reference (double), reference.py's V1 semantics.
  std::vector<double> ref(qrows * D, 0.0), ref_lse(qrows, -INFINITY);
  for (int s = 0; s < S; ++s) {
    const int L = std::min(std::max(c.lens[s], 0), capacity);
    for (int qi = 0; qi < QL; ++qi) {
      const jax_paged::TokenRange r = jax_paged::QueryRowRange(L, QL, qi, c.window);
      for (int h = 0; h < H; ++h) {
        const int kvh = h / G;
        const size_t row = (static_cast<size_t>(s) * QL + qi) * H + h;
        std::vector<double> lg;
        std::vector<int> toks;
        for (int t = r.start; t < r.end; ++t) {
          const int blk = table[s * max_blocks + t / BS];
          if (blk < 0 || blk >= num_blocks) continue;
          double dot = 0.0;
          for (int d = 0; d < D; ++d) dot += qv[row * D + d] * kval[kidx(blk, kvh, t % BS, d)] * ksc[kvh];
          double l = scale * dot;
          if (c.alibi) l += slopes[h] * static_cast<double>(t - (r.end - 1));
          if (c.cap > 0.0f) l = c.cap * std::tanh(l / c.cap);
          lg.push_back(l);
          toks.push_back(t);
        }
        if (lg.empty()) continue;
        double m = -std::numeric_limits<double>::max();
        for (double l : lg) m = std::max(m, l);
        double sum = 0.0;
        std::vector<double> acc(D, 0.0);
        for (size_t i = 0; i < lg.size(); ++i) {
          const double e = std::exp(lg[i] - m);
          sum += e;
          const int t = toks[i];
          const int blk = table[s * max_blocks + t / BS];
          for (int d = 0; d < D; ++d) acc[d] += e * vval[vidx(blk, kvh, t % BS, d)] * vsc[kvh];
        }
        for (int d = 0; d < D; ++d) ref[row * D + d] = acc[d] / (sum + 1e-6);
        ref_lse[row] = m + std::log(sum + 1e-6);
      }
    }
  }

  // Device buffers, outputs and workspace poisoned with NaN.
  std::vector<int32_t> lens(c.lens.begin(), c.lens.end());
  void* d_q = ToDevice(q16);
  void* d_k = fp8 ? static_cast<void*>(ToDevice(k8)) : static_cast<void*>(ToDevice(k16));
  void* d_v = fp8 ? static_cast<void*>(ToDevice(v8)) : static_cast<void*>(ToDevice(v16));
  int32_t* d_table = ToDevice(table);
  int32_t* d_lens = ToDevice(lens);
  float* d_slopes = ToDevice(slopes);
  float* d_ksc = ToDevice(ksc);
  float* d_vsc = ToDevice(vsc);
  std::vector<uint16_t> out_init(qrows * D, 0x7FFF);
  void* d_out = ToDevice(out_init);
  std::vector<float> lse_init(qrows, std::nanf(""));
  float* d_lse = ToDevice(lse_init);
  std::vector<float> ws(qrows * P, std::nanf("")), ws_out(qrows * P * D, std::nanf(""));
  float* d_es = ToDevice(ws);
  float* d_ml = ToDevice(ws);
  float* d_tmp = ToDevice(ws_out);

  PagedAttentionParams p;
  p.out = d_out;
  p.query = d_q;
  p.key_cache = d_k;
  p.value_cache = d_v;
  p.block_tables = d_table;
  p.seq_lens = d_lens;
  p.alibi_slopes = c.alibi ? d_slopes : nullptr;
  p.exp_sums = d_es;
  p.max_logits = d_ml;
  p.tmp_out = d_tmp;
  p.num_seqs = S;
  p.num_heads = H;
  p.num_kv_heads = Hkv;
  p.head_size = D;
  p.block_size = BS;
  p.max_blocks_per_seq = max_blocks;
  p.num_blocks = num_blocks;
  p.scale = scale;
  p.partition_size = ps;
  p.max_num_partitions = P;
  p.q_len = QL;
  p.soft_cap = c.cap;
  p.sliding_window = c.window;
  p.k_scale = c.scales ? d_ksc : nullptr;
  p.v_scale = c.scales ? d_vsc : nullptr;
  p.k_scale_stride = 1;
  p.v_scale_stride = 1;
  p.lse = c.lse ? d_lse : nullptr;
  p.query_kind = c.q == QK::kBf16 ? jax_paged::ScalarKind::kBF16 : jax_paged::ScalarKind::kF16;
  p.cache_kind = c.c == CK::kSame   ? jax_paged::CacheKind::kSameAsQuery
                 : c.c == CK::kE4m3 ? jax_paged::CacheKind::kFp8E4M3
                                    : jax_paged::CacheKind::kFp8E5M2;
  const cudaError_t launch = Launch(c, p);
  const cudaError_t sync = cudaDeviceSynchronize();
  std::vector<uint16_t> out(qrows * D);
  std::vector<float> lse(qrows);
  bool ok = launch == cudaSuccess && sync == cudaSuccess;
  if (ok) {
    CHECK_CUDA(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost));
  }
  double err = 0.0, lse_err = 0.0;
  if (ok) {
    for (size_t i = 0; i < out.size(); ++i) {
      const double v = FromBits(out[i], c.q);
      const double e =
          std::isfinite(v) ? std::fabs(v - ref[i]) / std::max(1.0, std::fabs(ref[i])) : INFINITY;
      err = std::max(err, e);
    }
    if (c.lse)
      for (size_t i = 0; i < qrows; ++i) {
        const double v = lse[i];
        double e;
        if (std::isinf(ref_lse[i]))
          e = (std::isinf(v) && v < 0) ? 0.0 : INFINITY;
        else
          e = std::isfinite(v) ? std::fabs(v - ref_lse[i]) : INFINITY;
        lse_err = std::max(lse_err, e);
      }
  }
  const double tol = fp8 ? kTolFp8 : (c.q == QK::kBf16 ? kTolBf16 : kTolF16);
  const bool pass = ok && err <= tol && lse_err <= kTolLse;
  std::printf("%-4s %-60s out %.3e (tol %.0e)  lse %.3e (tol %.0e)%s%s\n", pass ? "PASS" : "FAIL",
              c.name.c_str(), err, tol, lse_err, kTolLse, ok ? "" : "  launch/sync error: ",
              ok ? "" : cudaGetErrorString(launch != cudaSuccess ? launch : sync));
  if (!ok) std::exit(1);  // a sticky error: nothing after it can run
  for (void* ptr : {d_q, d_k, d_v, static_cast<void*>(d_table), static_cast<void*>(d_lens),
                    static_cast<void*>(d_slopes), static_cast<void*>(d_ksc),
                    static_cast<void*>(d_vsc), d_out, static_cast<void*>(d_lse),
                    static_cast<void*>(d_es), static_cast<void*>(d_ml), static_cast<void*>(d_tmp)})
    CHECK_CUDA(cudaFree(ptr));
  return pass;
}

std::string Name(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s/%s D=%d BS=%d g=%d q_len=%d ps=%d%s%s%s%s%s%s",
                c.q == QK::kBf16 ? "bf16" : "f16",
                c.c == CK::kSame ? "same" : (c.c == CK::kE4m3 ? "e4m3" : "e5m2"), c.d, c.bs,
                c.group, c.q_len, c.ps, c.window ? " window" : "", c.cap > 0 ? " cap" : "",
                c.alibi ? " alibi" : "", c.scales ? " scales" : "", c.invalid_page ? " badpage" : "",
                c.lse ? "" : " no-lse");
  std::string s(buf);
  if (c.window) s += "=" + std::to_string(c.window);
  return s;
}


// Reads n 16-byte words and folds them into one word per thread (kept alive by a
// store that never happens): the read-only bandwidth reference.
__global__ void ReadKernel(const uint4* __restrict__ src, size_t n, uint4* sink) {
  uint4 acc = make_uint4(0u, 0u, 0u, 0u);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = src[i];
    acc.x ^= v.x;
    acc.y ^= v.y;
    acc.z ^= v.z;
    acc.w ^= v.w;
  }
  if ((acc.x & acc.y & acc.z & acc.w) == 0xFFFFFFFFu) sink[0] = acc;
}

struct BenchCase {
  QK q;
  CK c;
  int seqs, kv_heads, group, len, d, bs, ps;
};

float TimeMs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.0f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

int Bench(int sms) {
  const BenchCase cases[] = {
      {QK::kBf16, CK::kSame, 64, 8, 4, 4096, 128, 16, 512},
      {QK::kBf16, CK::kSame, 32, 8, 8, 4096, 128, 16, 512},
      {QK::kBf16, CK::kSame, 128, 2, 4, 2048, 64, 16, 512},
      {QK::kBf16, CK::kSame, 64, 4, 2, 2048, 256, 16, 512},
      {QK::kBf16, CK::kE4m3, 64, 8, 4, 4096, 128, 16, 512},
      {QK::kBf16, CK::kSame, 1, 8, 4, 32768, 128, 16, 512},
      {QK::kBf16, CK::kE4m3, 1, 8, 4, 32768, 128, 16, 512},
  };
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  for (const BenchCase& b : cases) {
    const bool fp8 = b.c != CK::kSame;
    const int celem = fp8 ? 1 : 2;
    const int blocks_per_seq = (b.len + b.bs - 1) / b.bs;
    const int64_t num_blocks = int64_t{b.seqs} * blocks_per_seq;
    const size_t cache_bytes = static_cast<size_t>(num_blocks) * b.kv_heads * b.d * b.bs * celem;
    const int H = b.kv_heads * b.group;
    const int P = (blocks_per_seq * b.bs + b.ps - 1) / b.ps;
    std::vector<int32_t> table(static_cast<size_t>(b.seqs) * blocks_per_seq);
    for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
    std::vector<int32_t> lens(b.seqs, b.len);
    void *k, *v, *q, *out;
    float *es, *ml, *tmp;
    uint4* sink;
    CHECK_CUDA(cudaMalloc(&k, cache_bytes));
    CHECK_CUDA(cudaMalloc(&v, cache_bytes));
    CHECK_CUDA(cudaMemset(k, 0, cache_bytes));
    CHECK_CUDA(cudaMemset(v, 0, cache_bytes));
    CHECK_CUDA(cudaMalloc(&q, static_cast<size_t>(b.seqs) * H * b.d * 2));
    CHECK_CUDA(cudaMemset(q, 0, static_cast<size_t>(b.seqs) * H * b.d * 2));
    CHECK_CUDA(cudaMalloc(&out, static_cast<size_t>(b.seqs) * H * b.d * 2));
    CHECK_CUDA(cudaMalloc(&es, static_cast<size_t>(b.seqs) * H * P * 4));
    CHECK_CUDA(cudaMalloc(&ml, static_cast<size_t>(b.seqs) * H * P * 4));
    CHECK_CUDA(cudaMalloc(&tmp, static_cast<size_t>(b.seqs) * H * P * b.d * 4));
    CHECK_CUDA(cudaMalloc(&sink, 16));
    int32_t* d_table = ToDevice(table);
    int32_t* d_lens = ToDevice(lens);
    PagedAttentionParams p;
    p.out = out;
    p.query = q;
    p.key_cache = k;
    p.value_cache = v;
    p.block_tables = d_table;
    p.seq_lens = d_lens;
    p.exp_sums = es;
    p.max_logits = ml;
    p.tmp_out = tmp;
    p.num_seqs = b.seqs;
    p.num_heads = H;
    p.num_kv_heads = b.kv_heads;
    p.head_size = b.d;
    p.block_size = b.bs;
    p.max_blocks_per_seq = blocks_per_seq;
    p.num_blocks = num_blocks;
    p.scale = 1.0f / std::sqrt(static_cast<float>(b.d));
    p.partition_size = b.ps;
    p.max_num_partitions = P;
    Case c;
    c.q = b.q;
    c.c = b.c;
    c.d = b.d;
    constexpr int kIters = 20;
    for (int i = 0; i < 3; ++i) CHECK_CUDA(Launch(c, p));
    CHECK_CUDA(cudaEventRecord(e0));
    for (int i = 0; i < kIters; ++i) CHECK_CUDA(Launch(c, p));
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    const double attn_ms = TimeMs(e0, e1) / kIters;
    // The read reference: K then V, as one pass each.
    const size_t words = cache_bytes / 16;
    auto read = [&]() {
      ReadKernel<<<sms * 8, 256>>>(static_cast<const uint4*>(k), words, sink);
      ReadKernel<<<sms * 8, 256>>>(static_cast<const uint4*>(v), words, sink);
    };
    for (int i = 0; i < 3; ++i) read();
    CHECK_CUDA(cudaEventRecord(e0));
    for (int i = 0; i < kIters; ++i) read();
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    CHECK_CUDA(cudaGetLastError());
    const double read_ms = TimeMs(e0, e1) / kIters;
    const double bytes = 2.0 * cache_bytes;
    std::printf("%s/%s seqs=%d kv=%d g=%d len=%d D=%d BS=%d ps=%d: %.1f us, %.0f GB/s; read %.1f us, "
                "%.0f GB/s; %.1f%% of read\n",
                b.q == QK::kBf16 ? "bf16" : "f16", fp8 ? "e4m3" : "same", b.seqs, b.kv_heads,
                b.group, b.len, b.d, b.bs, b.ps, attn_ms * 1e3, bytes / attn_ms / 1e6,
                read_ms * 1e3, bytes / read_ms / 1e6, 100.0 * read_ms / attn_ms);
    for (void* ptr : {k, v, q, out, static_cast<void*>(es), static_cast<void*>(ml),
                      static_cast<void*>(tmp), static_cast<void*>(sink),
                      static_cast<void*>(d_table), static_cast<void*>(d_lens)})
      CHECK_CUDA(cudaFree(ptr));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0;
  CHECK_CUDA(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  if (argc > 1 && std::strcmp(argv[1], "--bench") == 0) return Bench(prop.multiProcessorCount);
  std::mt19937 rng(1234);
  std::vector<Case> cases;
  const int heads[] = {64, 80, 96, 112, 120, 128, 192, 256};
  const QK qks[] = {QK::kBf16, QK::kF16};
  const CK cks[] = {CK::kSame, CK::kE4m3, CK::kE5m2};
  // Base grid: every dtype pair, head size and block size; lengths 0, 1, a block
  // multiple, partition boundaries (ps = 64) +-1, and a long one.
  for (QK q : qks)
    for (CK ck : cks)
      for (int d : heads) {
        if (ck != CK::kSame && d % 16 != 0) continue;
        for (int bs : {8, 16, 32}) {
          Case c;
          c.q = q;
          c.c = ck;
          c.d = d;
          c.bs = bs;
          c.lens = {0, 1, 2 * bs, 63, 64, 65, 300};
          c.scales = ck != CK::kSame;
          cases.push_back(c);
        }
      }
  // Features, on a few head sizes and both 16-bit and fp8 caches.
  for (CK ck : {CK::kSame, CK::kE4m3})
    for (int d : {64, 128, 256}) {
      Case b;
      b.c = ck;
      b.d = d;
      b.lens = {0, 1, 17, 64, 129, 700};
      b.scales = ck != CK::kSame;
      Case c = b;
      c.window = 40;
      cases.push_back(c);           // window, split (the grid counts from the window)
      c.window = 200;
      c.ps = 32;
      c.bs = 32;
      cases.push_back(c);           // window over several small partitions
      c = b;
      c.cap = 5.0f;
      cases.push_back(c);           // soft cap
      c = b;
      c.q_len = 4;
      cases.push_back(c);           // multi-token, 16 rows per KV head
      c.group = 8;
      cases.push_back(c);           // 32 rows per KV head: two CTAs
      c.window = 24;
      c.alibi = true;
      cases.push_back(c);           // all together
      c = b;
      c.group = 1;
      c.kv_heads = 3;
      cases.push_back(c);           // MHA
      c = b;
      c.group = 8;
      c.alibi = true;
      cases.push_back(c);           // ALiBi
      c = b;
      c.ps = 0;
      cases.push_back(c);           // one partition: out / lse written directly
      c.window = 50;
      c.q_len = 4;
      c.cap = 3.0f;
      cases.push_back(c);
      c = b;
      c.invalid_page = true;
      c.bs = 8;
      cases.push_back(c);           // invalid block id inside a sequence
      c = b;
      c.lse = false;
      c.q = QK::kF16;
      cases.push_back(c);
      c = b;
      c.group = 5;
      c.q_len = 3;
      c.ps = 128;
      cases.push_back(c);           // odd group, 15 rows
    }
  int failed = 0;
  for (Case& c : cases) {
    c.name = Name(c);
    if (!RunCase(c, rng)) ++failed;
  }
  std::printf("%s: %d of %zu cases failed\n", failed ? "FAIL" : "PASS", failed, cases.size());
  return failed ? 1 : 0;
}
