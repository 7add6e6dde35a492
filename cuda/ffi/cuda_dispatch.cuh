// The CUDA handlers' compile-time size dispatch, in one place: head size and
// block size (the dtype dispatch is DispatchScalar in common.h). The lists of
// supported sizes come from kernels/launch.h, the same lists the
// cuda_attn_*.cu files instantiate, so dispatch and instantiation agree.
#pragma once

#include <string>
#include <type_traits>

#include "../kernels/launch.h"
#include "common.h"

namespace jax_paged {
namespace cuda {

#define JAX_PAGED_SIZE_STR_(unused, N) " " #N
#define JAX_PAGED_SIZE_CASE_(unused, N) \
  case N:                               \
    return true;

inline bool IsSupportedHeadSize(int head_size) {
  switch (head_size) { JAX_PAGED_HEAD_SIZES(JAX_PAGED_SIZE_CASE_, _) }
  return false;
}
inline bool IsSupportedBlockSize(int block_size) {
  switch (block_size) { JAX_PAGED_BLOCK_SIZES(JAX_PAGED_SIZE_CASE_, _) }
  return false;
}

inline ffi::Error UnsupportedHeadSize(int head_size) {
  return ArgError("the CUDA kernels do not support head_size " + std::to_string(head_size) +
                  "; supported:" JAX_PAGED_HEAD_SIZES(JAX_PAGED_SIZE_STR_, _));
}
inline ffi::Error UnsupportedBlockSize(int block_size) {
  return ArgError("the CUDA kernels do not support block_size " + std::to_string(block_size) +
                  "; supported:" JAX_PAGED_BLOCK_SIZES(JAX_PAGED_SIZE_STR_, _));
}

// Calls f(std::integral_constant<int, HEAD_SIZE>{}), or returns a clear error.
template <typename F>
ffi::Error DispatchHeadSize(int head_size, F&& f) {
#define JAX_PAGED_HEAD_CASE_(unused, N) \
  case N:                               \
    return f(std::integral_constant<int, N>{});
  switch (head_size) { JAX_PAGED_HEAD_SIZES(JAX_PAGED_HEAD_CASE_, _) }
#undef JAX_PAGED_HEAD_CASE_
  return UnsupportedHeadSize(head_size);
}

// Calls f(std::integral_constant<int, BLOCK_SIZE>{}), or returns a clear error.
template <typename F>
ffi::Error DispatchBlockSize(int block_size, F&& f) {
#define JAX_PAGED_BLOCK_CASE_(unused, N) \
  case N:                                \
    return f(std::integral_constant<int, N>{});
  switch (block_size) { JAX_PAGED_BLOCK_SIZES(JAX_PAGED_BLOCK_CASE_, _) }
#undef JAX_PAGED_BLOCK_CASE_
  return UnsupportedBlockSize(block_size);
}

#undef JAX_PAGED_SIZE_CASE_
#undef JAX_PAGED_SIZE_STR_

}  // namespace cuda
}  // namespace jax_paged
