// A minimal parallel-for for the CPU kernels. Threads are started per call:
// XLA's own intra-op pool could deadlock if we blocked inside it, and the
// start-up cost (tens of microseconds) only matters for tiny calls, which run
// on the calling thread anyway.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sched.h>
#endif

namespace jax_paged {
namespace cpu {

// Cores this process may use (affinity-aware), or JAX_PAGED_CPU_THREADS.
inline int AvailableThreads() {
  static const int n = [] {
    if (const char* env = std::getenv("JAX_PAGED_CPU_THREADS")) {
      const int v = std::atoi(env);
      if (v > 0) return v;
    }
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

// Runs fn(i) for i in [0, n). `work_per_item` is a rough element count used
// to avoid starting threads for small problems.
template <typename Fn>
void ParallelFor(int64_t n, int64_t work_per_item, Fn&& fn) {
  constexpr int64_t kMinWorkPerThread = 1 << 16;
  const int64_t total = n * std::max<int64_t>(work_per_item, 1);
  const int64_t threads = std::min<int64_t>(
      {static_cast<int64_t>(AvailableThreads()), n, std::max<int64_t>(1, total / kMinWorkPerThread)});
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace cpu
}  // namespace jax_paged
