// The cache kernels (reshape_and_cache for each key dtype into caches of that
// dtype or fp8, copy_blocks).
#include "cuda/cache_ops.cuh"

#define JAX_PAGED_INSTANTIATE_WRITE_(TIN, TC)                                 \
  template cudaError_t jax_paged::cuda::LaunchReshapeAndCache<TIN, TC>(       \
      const jax_paged::ReshapeAndCacheParams&, cudaStream_t);
JAX_PAGED_INSTANTIATE_WRITE_(float, float)
JAX_PAGED_INSTANTIATE_WRITE_(__half, __half)
JAX_PAGED_INSTANTIATE_WRITE_(__nv_bfloat16, __nv_bfloat16)
JAX_PAGED_INSTANTIATE_WRITE_(float, __nv_fp8_e4m3)
JAX_PAGED_INSTANTIATE_WRITE_(__half, __nv_fp8_e4m3)
JAX_PAGED_INSTANTIATE_WRITE_(__nv_bfloat16, __nv_fp8_e4m3)
JAX_PAGED_INSTANTIATE_WRITE_(float, __nv_fp8_e5m2)
JAX_PAGED_INSTANTIATE_WRITE_(__half, __nv_fp8_e5m2)
JAX_PAGED_INSTANTIATE_WRITE_(__nv_bfloat16, __nv_fp8_e5m2)
#undef JAX_PAGED_INSTANTIATE_WRITE_
