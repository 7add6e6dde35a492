// The grouped kernel's wgmma CTAs for e4m3 caches, built for sm_90a alone
// (CMakeLists.txt: JAX_PAGED_WGMMA), both development options:
//   * 64-row CTAs (JAX_PAGED_FP8_WGMMA=1): e4m3 x e4m3 products with the bf16
//     query rows and P split into two e4m3 terms each (kernels/wgmma.cuh,
//     grouped_attention.cuh's kWgmma with fp8 caches), head sizes 96 and 128,
//     16-token pages;
//   * 128-row CTAs (JAX_PAGED_FP8_WGMMA_128=1): the pages widened to f16 once for
//     the 16-bit form's products (kWiden), head size 128, 16-token pages.
#define JAX_PAGED_WGMMA_TU 1
#include "../kernels/grouped_attention.cuh"

JAX_PAGED_INSTANTIATE_GROUPED_WGMMA_FP8(96)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA_FP8(128)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA_FP8_128(__nv_bfloat16, __nv_fp8_e4m3, 128)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA_FP8_128(__half, __nv_fp8_e4m3, 128)
