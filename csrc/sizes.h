// The compile-time sizes the CUDA kernels are instantiated for: the one list.
// Framework-free and CUDA-free, so that the CPU module can export it to Python
// (jax_paged/_shapes.py reads it from there) and launch.h can instantiate it.
//
// Head sizes are split in two halves only to spread the instantiations over
// translation units; the supported set is their union.
// Each list calls X(ARGS..., size) per size, ARGS being the extra arguments.
#pragma once

#define JAX_PAGED_HEAD_SIZES_A(X, ...) \
  X(__VA_ARGS__, 64) X(__VA_ARGS__, 80) X(__VA_ARGS__, 96) X(__VA_ARGS__, 112)
#define JAX_PAGED_HEAD_SIZES_B(X, ...) \
  X(__VA_ARGS__, 120) X(__VA_ARGS__, 128) X(__VA_ARGS__, 192) X(__VA_ARGS__, 256)
#define JAX_PAGED_HEAD_SIZES(X, ...) \
  JAX_PAGED_HEAD_SIZES_A(X, __VA_ARGS__) JAX_PAGED_HEAD_SIZES_B(X, __VA_ARGS__)
#define JAX_PAGED_BLOCK_SIZES(X, ...) X(__VA_ARGS__, 8) X(__VA_ARGS__, 16) X(__VA_ARGS__, 32)
// fp8 caches (x = 16) need head_size % 16 == 0: every size above but 120.
#define JAX_PAGED_FP8_HEAD_SIZES_A(X, ...) \
  X(__VA_ARGS__, 64) X(__VA_ARGS__, 80) X(__VA_ARGS__, 96) X(__VA_ARGS__, 112)
#define JAX_PAGED_FP8_HEAD_SIZES_B(X, ...) X(__VA_ARGS__, 128) X(__VA_ARGS__, 192) X(__VA_ARGS__, 256)
#define JAX_PAGED_FP8_HEAD_SIZES(X, ...) \
  JAX_PAGED_FP8_HEAD_SIZES_A(X, __VA_ARGS__) JAX_PAGED_FP8_HEAD_SIZES_B(X, __VA_ARGS__)

namespace jax_paged {

// Largest head size any kernel (CPU or CUDA) takes; head sizes are multiples of 8.
constexpr int kMaxHeadSize = 256;
// Largest block size the FFI layer accepts (the CPU kernels' bound; the CUDA
// kernels take JAX_PAGED_BLOCK_SIZES only).
constexpr int kMaxBlockSize = 256;

}  // namespace jax_paged
