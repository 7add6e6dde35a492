// Instantiations of the grouped decode kernel (cuda/grouped_attention.cuh)
// for __nv_bfloat16 queries and caches, every supported head size (block size is a
// run-time parameter).
#include "cuda/grouped_attention.cuh"

JAX_PAGED_HEAD_SIZES(JAX_PAGED_INSTANTIATE_GROUPED, __nv_bfloat16, __nv_bfloat16)
