// What one kernel per call can do on this GPU: the per-call time of reading W
// bytes, back to back, with nothing but the reads.
//
// The grouped attention kernel's hardest shapes (fp8 caches at B=1 and at head
// size 64) are bound by per-call fixed costs, not streaming rate. This program
// measures the floor those shapes sit against, with the same method as
// the benchmark (per-call time of many back-to-back calls, median of samples,
// each call reading fresh data: the inputs rotate over >= 640 MB, far more than
// the 50 MB L2) and against the same reference (the copy bandwidth of y = x + 1
// over 2 GiB of float32, bytes read + written):
//
//   contiguous  a plain streaming read (16-byte loads, 4 in flight per thread),
//               the best a kernel without indirection does at each size;
//   paged       the grouped kernel's memory pipeline without its arithmetic:
//               pages at random places in a pool (a random permutation, like
//               the benchmark's block tables), page ids read from a table,
//               warp 0 copying each page with one cp.async.bulk into a
//               shared-memory stage completing on the stage's mbarrier, every
//               thread touching the stage, the stage refilled after a
//               __syncthreads. Shapes: CTAs per SM, stages, stage bytes, and a
//               grid of the grouped kernel's own size.
//   + tiny      the same call followed by a second small kernel (32 CTAs,
//               like the V2 reduce at B=1): what the second launch costs.
//   cluster     (`read_floor REPS cluster`: these cases only) the fp8 B=1 shape
//               in thread-block clusters whose CTAs, after their tiles, merge a
//               stand-in for their partial results through distributed shared
//               memory: the floor of split-K partitions merged inside a cluster
//               instead of by the V2 reduce's second kernel (with one cluster of
//               16 CTAs per KV head, 8 x 16 = 128 CTAs, one per SM, nothing is
//               left to merge after the call; such a grid need not fit in one
//               wave on every card).
//   hold        (`read_floor REPS hold`: these cases only) the fp8 head-64
//               shape with every thread waiting N SM cycles per tile, a
//               stand-in for the tile's arithmetic, before the stage's release
//               (the stage out of flight meanwhile, as in the attention kernel)
//               or after it (refilled first): how much a tile's compute time
//               costs the pipeline, and how much releasing early would recover.
//
// Build and run (CMake builds it as `jax_paged_read_floor` with
// -DJAX_PAGED_DEV=ON; or directly):
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -Icsrc \
//       dev/read_floor.cu -o read_floor && ./read_floor
//
// Output: one line per case, µs per call and % of the same-run copy bandwidth
// (a read-only kernel can exceed the copy figure, which mixes reads and
// writes). Launches are timed both as plain stream launches and as one CUDA
// graph of all the calls of a sample (XLA runs the benchmark's loop body as a
// command buffer, i.e. a graph).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/grouped_attention.cuh"  // the grouped kernel's mbarrier / bulk-copy wrappers

namespace g = jax_paged::cuda::grouped;
namespace cg = cooperative_groups;

#define CHECK(call)                                                                   \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,              \
                   cudaGetErrorString(e_));                                           \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace {

constexpr unsigned kMagic = 0x9e3779b9u;  // never the XOR of the data below (checked)
constexpr int kThreads = 128;              // the grouped kernel's CTA size

__global__ void CopyPlusOne(const float4* x, float4* y, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float4 v = x[i];
    v.x += 1.0f;
    v.y += 1.0f;
    v.z += 1.0f;
    v.w += 1.0f;
    y[i] = v;
  }
}

// Every 16-byte word of x[0, n) is loaded once; the XOR keeps the loads alive.
__global__ void ReadContiguous(const uint4* x, size_t n, unsigned* sink) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(x + i), b = __ldcs(x + i + stride);
    const uint4 c = __ldcs(x + i + 2 * stride), d = __ldcs(x + i + 3 * stride);
    acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w) ^ (c.x ^ c.y ^ c.z ^ c.w) ^
           (d.x ^ d.y ^ d.z ^ d.w);
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(x + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == kMagic) sink[0] = acc;
}

// Without `counter`: CTA c reads tiles [c * num_tiles / grid, (c + 1) *
// num_tiles / grid) of `pages_per_stage` pages each (page ids in `pages`,
// tile-major), through `stages` shared-memory stages: the grouped kernel's
// producer and stage ring without its arithmetic. With `counter` (zero at
// launch): the CTAs claim tiles one at a time from it (atomicAdd, one claim
// ahead of its use, like the table entries), so that CTAs served faster by
// the memory system take more tiles. hold_cycles > 0: every thread waits that
// many SM cycles per tile, a stand-in for the tile's arithmetic, before the
// stage's release (hold_after 0: the stage stays out of flight meanwhile, as
// in the attention kernel) or after it (1: the stage is refilled first, as if
// the tile's words were in registers). merge_floats > 0: after its tiles each CTA
// writes that many floats (a stand-in for its partition's partial result: rows x
// head size, each row's max and sum) into its shared memory; after a cluster
// barrier, the CTA of rank r sums the r-th slice of every CTA's floats through
// distributed shared memory and writes it to `merged` (one row of merge_floats per
// cluster), and a second barrier keeps every CTA's floats until all reads are done.
// Launched without a cluster, a CTA is a cluster of one.
__global__ void ReadPaged(const unsigned char* pool, const int* pages, int num_tiles,
                          int page_bytes, int pages_per_stage, int stages, int* counter,
                          unsigned* sink, int hold_cycles = 0, int hold_after = 0,
                          int merge_floats = 0, float* merged = nullptr) {
#if JAX_PAGED_GROUPED_SM90
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int stage_bytes = pages_per_stage * page_bytes;
  const uint32_t base = g::SmemAddr(smem);
  const uint32_t bar0 = base + static_cast<uint32_t>(stages * stage_bytes);
  volatile int* tile_s = reinterpret_cast<volatile int*>(smem + stages * stage_bytes + 8 * stages);
  const int tile0 = static_cast<int>(static_cast<long long>(blockIdx.x) * num_tiles / gridDim.x);
  const int tile1 =
      static_cast<int>(static_cast<long long>(blockIdx.x + 1) * num_tiles / gridDim.x);
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) g::MbarInit(bar0 + 8 * s, 1);
    g::FenceMbarInit();
  }
  __syncthreads();
  int issued = 0;  // warp 0: tiles claimed so far
  auto claim = [&]() -> int {  // warp 0: the next tile of this CTA, num_tiles when none
    int t;
    if (counter == nullptr) {
      t = tile0 + issued < tile1 ? tile0 + issued : num_tiles;
    } else {
      t = 0;
      if (lane == 0) t = atomicAdd(counter, 1);
      t = min(__shfl_sync(0xffffffffu, t, 0), num_tiles);
    }
    ++issued;
    return t;
  };
  auto entry_of = [&](int t) -> int {  // warp 0: this lane's page of tile t
    return (t < num_tiles && lane < pages_per_stage)
               ? pages[static_cast<long long>(t) * pages_per_stage + lane]
               : -1;
  };
  // Fill stage s with tile t (or mark it as the end).
  auto issue = [&](int s, int t, int page) {  // warp 0
    const uint32_t bar = bar0 + 8 * s;
    if (lane == 0) {
      tile_s[s] = t;  // published by the arrive (release)
      g::MbarArriveExpectTx(bar, t < num_tiles ? static_cast<uint32_t>(stage_bytes) : 0u);
    }
    __syncwarp();
    if (t < num_tiles && lane < pages_per_stage)
      g::BulkCopyG2S(base + s * stage_bytes + lane * page_bytes,
                     pool + static_cast<long long>(page) * page_bytes, page_bytes, bar);
  };
  int next_tile = num_tiles, next_page = -1;  // warp 0: one claim ahead
  if (warp == 0) {
    for (int s = 0; s < stages; ++s) {
      const int t = claim();
      issue(s, t, entry_of(t));
    }
    next_tile = claim();
    next_page = entry_of(next_tile);
  }
  unsigned acc = 0;
  int s = 0;
  uint32_t phase = 0;
  for (;;) {
    g::MbarWait(bar0 + 8 * s, phase);
    if (tile_s[s] >= num_tiles) break;  // the same for every thread
    acc ^= reinterpret_cast<const unsigned*>(smem + s * stage_bytes)[tid];
    auto hold = [&] {
      const long long t0 = clock64();
      while (clock64() - t0 < hold_cycles) {
      }
    };
    if (hold_cycles > 0 && !hold_after) hold();
    __syncthreads();  // the stage is free again
    if (warp == 0) {
      issue(s, next_tile, next_page);
      if (next_tile < num_tiles) {
        next_tile = claim();
        next_page = entry_of(next_tile);
      }
    }
    if (hold_cycles > 0 && hold_after) hold();
    if (++s == stages) {
      s = 0;
      phase ^= 1u;
    }
  }
  if (merge_floats > 0) {
    // (Every tile was consumed before the end marker: no copy still lands in the stages.)
    cg::cluster_group cluster = cg::this_cluster();
    float* part = reinterpret_cast<float*>(smem);
    __syncthreads();
    for (int i = tid; i < merge_floats; i += blockDim.x) part[i] = static_cast<float>(acc & 0xffu);
    cluster.sync();
    const int ranks = static_cast<int>(cluster.num_blocks());
    const int rank = static_cast<int>(cluster.block_rank());
    const int chunk = (merge_floats + ranks - 1) / ranks;
    const int hi = min(merge_floats, (rank + 1) * chunk);
    for (int i = rank * chunk + tid; i < hi; i += blockDim.x) {
      float sum = 0.0f;
      for (int r = 0; r < ranks; ++r) sum += cluster.map_shared_rank(part, r)[i];
      merged[static_cast<long long>(blockIdx.x / ranks) * merge_floats + i] = sum;
    }
    cluster.sync();
  }
  if (acc == kMagic) sink[0] = acc;
#endif
}

// A stand-in for the V2 reduce at B=1: 32 CTAs read 64 KB and write 16 KB.
__global__ void Tiny(const float* in, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = 0.0f;
  for (int k = 0; k < 4; ++k) v += in[k * 4096 + i];
  out[i] = v;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// µs per call: `calls` launches (launch(i) makes call i) per sample, median of
// `reps` samples after one warm-up sample; as stream launches or as one graph.
template <class Launch>
float UsPerCall(Launch launch, int calls, int reps, bool graph, cudaStream_t stream) {
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) launch(i);
    CHECK(cudaStreamEndCapture(stream, &g));
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    CHECK(cudaGraphDestroy(g));
  }
  std::vector<float> us;
  for (int r = 0; r <= reps; ++r) {
    CHECK(cudaEventRecord(t0, stream));
    if (graph) {
      CHECK(cudaGraphLaunch(exec, stream));
    } else {
      for (int i = 0; i < calls; ++i) launch(i);
    }
    CHECK(cudaEventRecord(t1, stream));
    CHECK(cudaEventSynchronize(t1));
    CHECK(cudaGetLastError());
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (r > 0) us.push_back(1000.0f * ms / calls);  // sample 0 is the warm-up
  }
  if (exec) CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  return Median(us);
}

struct PagedCase {
  const char* what;
  int page_bytes;
  int pages_per_stage;
  int stages;
  int ctas_per_sm;  // shared memory is padded so that exactly this many fit
  int grid;         // 0: ctas_per_sm x SMs
  bool tiny;        // a second small kernel after each call
  int dynamic;      // 1: tiles claimed from a counter zeroed by a memset before each call;
                    // 2: static tiles, the same memset (its cost alone)
  int hold_cycles = 0;  // per tile, before (hold_after 0) or after (1) the stage's release
  int hold_after = 0;
  int cluster = 0;  // CTAs per thread-block cluster, whose partials merge (0: a plain launch)
};

// The partial result each CTA of a cluster case merges (ReadPaged's merge_floats): 4 query
// rows x head size 128, plus each row's max and sum.
constexpr int kMergeFloats = 4 * 128 + 2 * 4;
// The buffer the clusters' merged partials are written to (grid / cluster rows of kMergeFloats).
constexpr size_t kMergedBytes = size_t{1} << 22;

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  // `read_floor REPS hold`: only the hold cases (a tile's arithmetic held before
  // or after its stage's release, at the fp8 head-64 shape).
  const bool hold_only = argc > 2 && std::string(argv[2]) == "hold";
  // `read_floor REPS cluster`: only the cluster cases (split-K merged in clusters).
  const bool cluster_only = argc > 2 && std::string(argv[2]) == "cluster";
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("device %s, %d SMs, L2 %d MB, reps %d\n", prop.name, sms, prop.l2CacheSize >> 20,
              reps);

  // ---- the reference: copy bandwidth (y = x + 1, 2 GiB of float32) ----------
  const size_t copy_bytes = size_t{2} << 30;
  float4 *cx, *cy;
  CHECK(cudaMalloc(&cx, copy_bytes));
  CHECK(cudaMalloc(&cy, copy_bytes));
  CHECK(cudaMemset(cx, 0, copy_bytes));
  const size_t n4 = copy_bytes / sizeof(float4);
  const float copy_us = UsPerCall(
      [&](int) { CopyPlusOne<<<sms * 8, 512, 0, stream>>>(cx, cy, n4); }, 4, reps, false, stream);
  const double copy_tbps = 2.0 * copy_bytes / (copy_us * 1e-6) / 1e12;
  std::printf("copy bandwidth %.2f TB/s (%.1f us per 2 GiB pass)\n", copy_tbps, copy_us);
  CHECK(cudaFree(cx));
  CHECK(cudaFree(cy));

  // ---- the data: a pool of >= 640 MB of random words, read in rotation -------
  const size_t pool_bytes = size_t{1} << 30;
  unsigned char* pool;
  CHECK(cudaMalloc(&pool, pool_bytes));
  {
    std::vector<unsigned> host(pool_bytes / 4);
    std::mt19937 rng(1);
    for (auto& w : host) w = rng();
    CHECK(cudaMemcpy(pool, host.data(), pool_bytes, cudaMemcpyHostToDevice));
  }
  unsigned* sink;
  int* counter;
  CHECK(cudaMalloc(&counter, sizeof(int)));
  float *tiny_in, *tiny_out;
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMalloc(&tiny_in, 4 * 4096 * sizeof(float)));
  CHECK(cudaMalloc(&tiny_out, 4096 * sizeof(float)));
  CHECK(cudaMemset(tiny_in, 0, 4 * 4096 * sizeof(float)));
  const size_t rotate_bytes = size_t{640} << 20;
  const int calls = 64;

  auto report = [&](const std::string& name, double bytes, float us_stream, float us_graph) {
    auto pct = [&](float us) { return 100.0 * bytes / (us * 1e-6) / 1e12 / copy_tbps; };
    std::printf("%-58s %7.1f MB  stream %7.2f us (%5.1f%%)  graph %7.2f us (%5.1f%%)\n",
                name.c_str(), bytes / 1e6, us_stream, pct(us_stream), us_graph, pct(us_graph));
  };

  // ---- contiguous reads, per-call time against bytes ------------------------
  const double mb = 1 << 20;
  for (double w_mb : {8.0, 16.0, 32.0, 64.0, 128.0, 256.0}) {
    if (hold_only || cluster_only) break;
    const size_t w = static_cast<size_t>(w_mb * mb);
    const int sets = static_cast<int>(std::min<size_t>(pool_bytes / w, std::max<size_t>(2, (rotate_bytes + w - 1) / w)));
    const uint4* x = reinterpret_cast<const uint4*>(pool);
    const size_t n16 = w / 16;
    auto launch = [&](int i) {
      ReadContiguous<<<sms * 4, 256, 0, stream>>>(x + (i % sets) * n16, n16, sink);
    };
    char name[96];
    std::snprintf(name, sizeof(name), "contiguous read (%d sets)", sets);
    report(name, static_cast<double>(w), UsPerCall(launch, calls, reps, false, stream),
           UsPerCall(launch, calls, reps, true, stream));
  }

  // ---- paged reads ------------------------------------------------------------
  // fp8 B=1 L=32768 (head 128, block 16, 8 KV heads): 2 KB pages, 64 MiB of K
  // and V; the grouped kernel runs 512 CTAs of 8 tiles, 16 KB stages (4 K + 4
  // V pages), 3 stages, 4 CTAs per SM. fp8 64x32x8x4096 head 64: 1 KB pages,
  // 256 MiB; 512 CTAs of 32 tiles, 16 KB stages (8 + 8 pages), 3 stages, 4 per SM.
  const std::vector<std::pair<double, std::vector<PagedCase>>> groups = {
      {64.0,
       {{"as grouped fp8 B=1: 512 CTAs, 3 x 16 KB, 4/SM", 2048, 8, 3, 4, 512, false, 0},
        {"as grouped fp8 B=1, + tiny kernel", 2048, 8, 3, 4, 512, true, 0},
        {"4/SM x SMs CTAs, 3 x 16 KB", 2048, 8, 3, 4, 0, false, 0},
        {"4/SM x SMs CTAs, 3 x 16 KB, + tiny kernel", 2048, 8, 3, 4, 0, true, 0},
        {"4/SM x SMs CTAs, 3 x 16 KB, + memset", 2048, 8, 3, 4, 0, false, 2},
        {"4/SM x SMs CTAs, 3 x 16 KB, dynamic tiles (+ memset)", 2048, 8, 3, 4, 0, false, 1},
        {"2/SM, 6 x 16 KB", 2048, 8, 6, 2, 0, false, 0},
        {"1/SM, 12 x 16 KB", 2048, 8, 12, 1, 0, false, 0},
        {"2/SM, 3 x 32 KB", 2048, 16, 3, 2, 0, false, 0},
        {"8/SM, 3 x 8 KB", 2048, 4, 3, 8, 0, false, 0},
        {"4/SM, 3 x 16 KB, 4 KB pages", 4096, 4, 3, 4, 0, false, 0},
        {"4/SM, 3 x 16 KB, 1 KB pages", 1024, 16, 3, 4, 0, false, 0}}},
      {256.0,
       {{"as grouped fp8 head 64: 512 CTAs, 3 x 16 KB, 4/SM, 1 KB", 1024, 16, 3, 4, 512, false, 0},
        {"4/SM x SMs CTAs, 3 x 16 KB, 1 KB pages", 1024, 16, 3, 4, 0, false, 0},
        {"4/SM x SMs CTAs, 3 x 16 KB, 1 KB pages, + memset", 1024, 16, 3, 4, 0, false, 2},
        {"4/SM x SMs CTAs, 3 x 16 KB, 1 KB pages, dynamic (+ memset)", 1024, 16, 3, 4, 0, false, 1},
        {"2/SM, 6 x 16 KB, 1 KB pages", 1024, 16, 6, 2, 0, false, 0},
        {"4/SM, 3 x 16 KB, 2 KB pages", 2048, 8, 3, 4, 0, false, 0},
        {"bf16-like: 512 CTAs, 3 x 32 KB, 2/SM, 4 KB pages", 4096, 8, 3, 2, 512,
         false}}}};
  // The hold cases (only with `hold`): the fp8 head-64 shape with a stand-in
  // for each tile's arithmetic, held before or after the stage's release.
  std::vector<std::string> hold_names;
  std::vector<PagedCase> hold_cases;
  for (int cycles : {0, 500, 1000, 2000, 4000})
    for (int after : {0, 1}) {
      if (cycles == 0 && after) continue;
      hold_names.push_back("as fp8 head 64, hold " + std::to_string(cycles) + " cycles per tile " +
                           (after ? "after" : "before") + " release");
      hold_cases.push_back({nullptr, 1024, 16, 3, 4, 512, false, 0, cycles, after});
    }
  for (size_t i = 0; i < hold_cases.size(); ++i) hold_cases[i].what = hold_names[i].c_str();
  const std::vector<std::pair<double, std::vector<PagedCase>>> hold_group = {{256.0, hold_cases}};
  // The cluster cases (only with `cluster`): the fp8 B=1 shape (8 KV heads, 2 KB
  // pages), each CTA a partition whose partial result (kMergeFloats) is merged in its
  // cluster. With clusters of 16 at 128 CTAs
  // each KV head's partitions are one cluster; at 256 CTAs two clusters per KV head
  // would still leave two partials to merge, at 512 four. Against them the plain
  // launches of the same shapes and the grouped kernel's own shape with the second
  // kernel that stands in for the V2 reduce.
  const std::vector<std::pair<double, std::vector<PagedCase>>> cluster_group = {
      {64.0,
       {{"as grouped fp8 B=1, + tiny kernel (the reduce's stand-in)", 2048, 8, 3, 4, 512, true, 0},
        {"1/SM, 6 x 32 KB, plain launch", 2048, 16, 6, 1, 128, false, 0},
        {"1/SM, 6 x 32 KB, clusters of 16, merged (none left)", 2048, 16, 6, 1, 128, false, 0, 0,
         0, 16},
        {"1/SM, 12 x 16 KB, clusters of 16, merged (none left)", 2048, 8, 12, 1, 128, false, 0, 0,
         0, 16},
        {"2/SM, 3 x 32 KB, plain launch", 2048, 16, 3, 2, 256, false, 0},
        {"2/SM, 3 x 32 KB, clusters of 16, merged (2 per KV head left)", 2048, 16, 3, 2, 256,
         false, 0, 0, 0, 16},
        {"2/SM, 3 x 32 KB, clusters of 8, merged (4 per KV head left)", 2048, 16, 3, 2, 256,
         false, 0, 0, 0, 8},
        {"4/SM, 3 x 16 KB, clusters of 16, merged (4 per KV head left)", 2048, 8, 3, 4, 512,
         false, 0, 0, 0, 16}}}};
  float* merged;
  CHECK(cudaMalloc(&merged, kMergedBytes));
  // Clusters of 16 are beyond the portable 8 (Hopper allows them).
  CHECK(cudaFuncSetAttribute(ReadPaged, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  std::mt19937 rng(7);
  int* pages_dev;
  CHECK(cudaMalloc(&pages_dev, (pool_bytes / 1024) * sizeof(int)));
  CHECK(cudaFuncSetAttribute(ReadPaged, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(prop.sharedMemPerMultiprocessor) - 1024));
  for (const auto& [w_mb, cases] : hold_only ? hold_group : cluster_only ? cluster_group : groups) {
    const size_t w = static_cast<size_t>(w_mb * mb);
    const int sets = static_cast<int>(std::max<size_t>(2, (rotate_bytes + w - 1) / w));
    std::printf("paged read of %.1f MB per call (%d sets)\n", w / 1e6, sets);
    for (const PagedCase& c : cases) {
      const int pool_pages = static_cast<int>(pool_bytes / c.page_bytes);
      const int pages_per_call = static_cast<int>(w / c.page_bytes);
      if (static_cast<long long>(pages_per_call) * sets > pool_pages) {
        std::printf("  %s: pool too small\n", c.what);
        continue;
      }
      // A random permutation of the pool's pages; set i takes its slice.
      std::vector<int> perm(pool_pages);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      CHECK(cudaMemcpy(pages_dev, perm.data(), static_cast<size_t>(pages_per_call) * sets * sizeof(int),
                       cudaMemcpyHostToDevice));
      const int stage_bytes = c.page_bytes * c.pages_per_stage;
      const int num_tiles = pages_per_call / c.pages_per_stage;
      const int grid = c.grid > 0 ? c.grid : c.ctas_per_sm * sms;
      // Pad the shared memory so that exactly ctas_per_sm CTAs fit on an SM
      // (1 KB per CTA is reserved by the hardware).
      const int need = c.stages * stage_bytes + 12 * c.stages;
      const int pad = static_cast<int>(prop.sharedMemPerMultiprocessor) / c.ctas_per_sm - 1024;
      if (need > pad) {
        std::printf("  %s: %d B of shared memory do not fit %d per SM\n", c.what, need, c.ctas_per_sm);
        continue;
      }
      int fit = 0;
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, ReadPaged, kThreads, pad));
      // Every case through one launch path, the cluster cases with their cluster size.
      cudaLaunchAttribute cluster_attr{};
      cluster_attr.id = cudaLaunchAttributeClusterDimension;
      cluster_attr.val.clusterDim.x = static_cast<unsigned>(c.cluster);
      cluster_attr.val.clusterDim.y = cluster_attr.val.clusterDim.z = 1;
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(static_cast<unsigned>(grid));
      config.blockDim = dim3(kThreads);
      config.dynamicSmemBytes = static_cast<size_t>(pad);
      config.stream = stream;
      config.attrs = &cluster_attr;
      config.numAttrs = c.cluster > 0 ? 1 : 0;
      const int merge_floats = c.cluster > 0 ? kMergeFloats : 0;
      int clusters_fit = 0;  // (a grid of more clusters runs in waves)
      if (c.cluster > 0) {
        if (grid % c.cluster != 0 ||
            static_cast<size_t>(grid / c.cluster) * kMergeFloats * sizeof(float) > kMergedBytes) {
          std::printf("  %s: grid %d does not fit clusters of %d\n", c.what, grid, c.cluster);
          continue;
        }
        CHECK(cudaOccupancyMaxActiveClusters(&clusters_fit, ReadPaged, &config));
      }
      auto launch = [&](int i) {
        if (c.dynamic != 0) CHECK(cudaMemsetAsync(counter, 0, sizeof(int), stream));
        const int* pages = pages_dev + static_cast<size_t>(i % sets) * pages_per_call;
        CHECK(cudaLaunchKernelEx(&config, ReadPaged, static_cast<const unsigned char*>(pool),
                                 pages, num_tiles, c.page_bytes, c.pages_per_stage, c.stages,
                                 c.dynamic == 1 ? counter : nullptr, sink, c.hold_cycles,
                                 c.hold_after, merge_floats, merged));
        if (c.tiny) Tiny<<<32, kThreads, 0, stream>>>(tiny_in, tiny_out);
      };
      char name[160];
      if (c.cluster > 0)
        std::snprintf(name, sizeof(name), "  %s [grid %d, %d/SM fit, %d clusters of %d fit]",
                      c.what, grid, fit, clusters_fit, c.cluster);
      else
        std::snprintf(name, sizeof(name), "  %s [grid %d, %d/SM fit]", c.what, grid, fit);
      report(name, static_cast<double>(num_tiles) * stage_bytes,
             UsPerCall(launch, calls, reps, false, stream), UsPerCall(launch, calls, reps, true, stream));
    }
  }
  unsigned s = 0;
  CHECK(cudaMemcpy(&s, sink, 4, cudaMemcpyDeviceToHost));  // (never kMagic in practice)
  CHECK(cudaFree(pool));
  CHECK(cudaFree(pages_dev));
  CHECK(cudaFree(merged));
  return 0;
}
