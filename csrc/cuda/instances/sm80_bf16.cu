// Instantiations of the portable grouped decode kernel (sm80/kernel.cuh) for
// __nv_bfloat16 queries and caches, every supported head size (block size is a
// run-time parameter).
#include "cuda/sm80/kernel.cuh"

JAX_PAGED_HEAD_SIZES(JAX_PAGED_INSTANTIATE_SM80, __nv_bfloat16, __nv_bfloat16)
