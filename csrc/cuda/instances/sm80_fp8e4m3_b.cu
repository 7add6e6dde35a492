// Instantiations of the portable grouped decode kernel (sm80/kernel.cuh) for
// __nv_fp8_e4m3 caches under float16 and bfloat16 queries (the query type is a
// template argument, as in the Hopper grouped units), head sizes
// JAX_PAGED_FP8_HEAD_SIZES_B; the other half is a unit of its own so that the two
// compile in parallel.
#include "cuda/sm80/kernel.cuh"

JAX_PAGED_FP8_HEAD_SIZES_B(JAX_PAGED_INSTANTIATE_SM80, __half, __nv_fp8_e4m3)
JAX_PAGED_FP8_HEAD_SIZES_B(JAX_PAGED_INSTANTIATE_SM80, __nv_bfloat16, __nv_fp8_e4m3)
