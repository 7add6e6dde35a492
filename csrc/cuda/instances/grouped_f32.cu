// Instantiations of the grouped decode kernel (cuda/grouped_attention.cuh)
// for float queries and caches, every supported head size (block size is a
// run-time parameter).
#include "cuda/grouped_attention.cuh"

JAX_PAGED_HEAD_SIZES(JAX_PAGED_INSTANTIATE_GROUPED, float, float)
