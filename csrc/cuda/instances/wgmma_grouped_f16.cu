// The grouped kernel's 64-row row-split CTAs on warpgroup products (wgmma,
// kernels/wgmma.cuh) for __half queries and caches, head sizes 80-128 (% 16 == 0).
// Built for sm_90a alone (CMakeLists.txt: JAX_PAGED_WGMMA); the launchers in
// cuda_grouped_*.cu pick these on compute capability 9.0 unless JAX_PAGED_WGMMA=0
// (WgmmaEnabled).
#define JAX_PAGED_WGMMA_TU 1
#include "cuda/grouped_attention.cuh"

JAX_PAGED_INSTANTIATE_GROUPED_WGMMA(__half, 80)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA(__half, 96)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA(__half, 112)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA(__half, 128)
