// The grouped kernel's 128-row wgmma CTAs for e5m2 caches (development:
// JAX_PAGED_FP8_WGMMA_128=1): the pages widened to f16 once for the 16-bit form's
// products (grouped_attention.cuh's kWiden), head size 128, 16-token pages. Built
// for sm_90a alone (CMakeLists.txt: JAX_PAGED_WGMMA).
#define JAX_PAGED_WGMMA_TU 1
#include "../kernels/grouped_attention.cuh"

JAX_PAGED_INSTANTIATE_GROUPED_WGMMA_FP8_128(__nv_bfloat16, __nv_fp8_e5m2, 128)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA_FP8_128(__half, __nv_fp8_e5m2, 128)
