// Explicit instantiations of the paged-attention launchers (V1 + V2 + reduce)
// for __nv_fp8_e4m3 caches (query dtype chosen at run time) and head sizes
// JAX_PAGED_FP8_HEAD_SIZES_B x every block size.
#include "cuda/paged_attention.cuh"

JAX_PAGED_FP8_HEAD_SIZES_B(JAX_PAGED_INSTANTIATE_ATTN_FP8_H, __nv_fp8_e4m3)
