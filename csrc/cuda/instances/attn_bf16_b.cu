// Explicit instantiations of the paged-attention launchers (V1 + V2 + reduce)
// for __nv_bfloat16 and head sizes JAX_PAGED_HEAD_SIZES_B x every block size.
// Split per (dtype, half of the head sizes) so the build runs in parallel.
#include "cuda/paged_attention.cuh"

JAX_PAGED_HEAD_SIZES_B(JAX_PAGED_INSTANTIATE_ATTN_H, __nv_bfloat16)
