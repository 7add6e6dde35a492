// The grouped kernel's row-split CTAs on warpgroup products (wgmma,
// cuda/wgmma.cuh) for __nv_bfloat16 queries and caches, head sizes 80-128 (% 16 == 0):
// 64-row CTAs and 128-row ones. Built for sm_90a alone (CMakeLists.txt); the
// launchers in instances/grouped_*.cu pick these on compute capability 9.0
// (WgmmaEnabled).
#define JAX_PAGED_WGMMA_TU 1
#include "cuda/grouped_attention.cuh"

JAX_PAGED_INSTANTIATE_GROUPED_WGMMA(__nv_bfloat16, 80)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA(__nv_bfloat16, 96)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA(__nv_bfloat16, 112)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA(__nv_bfloat16, 128)
