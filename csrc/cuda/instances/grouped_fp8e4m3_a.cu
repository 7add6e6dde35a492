// Instantiations of the grouped decode kernel (cuda/grouped_attention.cuh)
// for __nv_fp8_e4m3 caches under float16 and bfloat16 queries, head sizes
// JAX_PAGED_FP8_HEAD_SIZES_A; the other half of the fp8 head sizes,
// JAX_PAGED_FP8_HEAD_SIZES_B (_b.cu), is a unit of its own so that the two
// compile in parallel (the fp8 units are the build's longest).
#include "cuda/grouped_attention.cuh"

JAX_PAGED_FP8_HEAD_SIZES_A(JAX_PAGED_INSTANTIATE_GROUPED, __half, __nv_fp8_e4m3)
JAX_PAGED_FP8_HEAD_SIZES_A(JAX_PAGED_INSTANTIATE_GROUPED, __nv_bfloat16, __nv_fp8_e4m3)
