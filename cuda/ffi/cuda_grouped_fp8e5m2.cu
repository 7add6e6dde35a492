// Instantiations of the grouped decode kernel (kernels/grouped_attention.cuh)
// for __nv_fp8_e5m2 caches under float16 and bfloat16 queries, every head size that
// is a multiple of 16.
#include "../kernels/grouped_attention.cuh"

JAX_PAGED_FP8_HEAD_SIZES_A(JAX_PAGED_INSTANTIATE_GROUPED, __half, __nv_fp8_e5m2)
JAX_PAGED_FP8_HEAD_SIZES_B(JAX_PAGED_INSTANTIATE_GROUPED, __half, __nv_fp8_e5m2)
JAX_PAGED_FP8_HEAD_SIZES_A(JAX_PAGED_INSTANTIATE_GROUPED, __nv_bfloat16, __nv_fp8_e5m2)
JAX_PAGED_FP8_HEAD_SIZES_B(JAX_PAGED_INSTANTIATE_GROUPED, __nv_bfloat16, __nv_fp8_e5m2)
