// The cache kernels (reshape_and_cache for each dtype, copy_blocks).
#include "../kernels/cache_ops.cuh"

template cudaError_t jax_paged::cuda::LaunchReshapeAndCache<float>(
    const jax_paged::ReshapeAndCacheParams&, cudaStream_t);
template cudaError_t jax_paged::cuda::LaunchReshapeAndCache<__half>(
    const jax_paged::ReshapeAndCacheParams&, cudaStream_t);
template cudaError_t jax_paged::cuda::LaunchReshapeAndCache<__nv_bfloat16>(
    const jax_paged::ReshapeAndCacheParams&, cudaStream_t);
