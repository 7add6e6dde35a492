// Explicit instantiations of the paged-attention launchers (V1 + V2 + reduce)
// for float and head sizes JAX_PAGED_HEAD_SIZES_A x every block size.
// Split per (dtype, half of the head sizes) so the build runs in parallel.
#include "cuda/paged_attention.cuh"

JAX_PAGED_HEAD_SIZES_A(JAX_PAGED_INSTANTIATE_ATTN_H, float)
