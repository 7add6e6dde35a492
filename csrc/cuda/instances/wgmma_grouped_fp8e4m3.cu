// The grouped kernel's 64-row row-split CTAs on warpgroup products for e4m3
// caches (development: JAX_PAGED_FP8_WGMMA=1): e4m3 x e4m3 products with the bf16
// query rows and P split into two e4m3 terms each (kernels/wgmma.cuh,
// grouped_attention.cuh's kWgmma with fp8 caches), head sizes 96 and 128,
// 16-token pages. Built for sm_90a alone (CMakeLists.txt: JAX_PAGED_WGMMA).
#define JAX_PAGED_WGMMA_TU 1
#include "cuda/grouped_attention.cuh"

JAX_PAGED_INSTANTIATE_GROUPED_WGMMA_FP8(96)
JAX_PAGED_INSTANTIATE_GROUPED_WGMMA_FP8(128)
