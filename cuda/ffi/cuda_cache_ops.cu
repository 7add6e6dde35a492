// The cache kernels (reshape_and_cache for each dtype and the quantised fp8
// write, copy_blocks).
#include "../kernels/cache_ops.cuh"

template cudaError_t jax_paged::cuda::LaunchReshapeAndCache<float>(
    const jax_paged::ReshapeAndCacheParams&, cudaStream_t);
template cudaError_t jax_paged::cuda::LaunchReshapeAndCache<__half>(
    const jax_paged::ReshapeAndCacheParams&, cudaStream_t);
template cudaError_t jax_paged::cuda::LaunchReshapeAndCache<__nv_bfloat16>(
    const jax_paged::ReshapeAndCacheParams&, cudaStream_t);

// Quantised writes into fp8 caches, for every key dtype.
#define JAX_PAGED_INSTANTIATE_QUANT_(TIN, TC)                                      \
  template cudaError_t jax_paged::cuda::LaunchReshapeAndCacheQuant<TIN, TC>(       \
      const jax_paged::ReshapeAndCacheParams&, cudaStream_t);
JAX_PAGED_INSTANTIATE_QUANT_(float, __nv_fp8_e4m3)
JAX_PAGED_INSTANTIATE_QUANT_(__half, __nv_fp8_e4m3)
JAX_PAGED_INSTANTIATE_QUANT_(__nv_bfloat16, __nv_fp8_e4m3)
JAX_PAGED_INSTANTIATE_QUANT_(float, __nv_fp8_e5m2)
JAX_PAGED_INSTANTIATE_QUANT_(__half, __nv_fp8_e5m2)
JAX_PAGED_INSTANTIATE_QUANT_(__nv_bfloat16, __nv_fp8_e5m2)
#undef JAX_PAGED_INSTANTIATE_QUANT_
