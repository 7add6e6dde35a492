// Python module exposing one platform's FFI handlers as capsules for
// jax.ffi.register_ffi_target. Compiled twice by CMake: as `_cpu` (the CPU
// handlers) and, with JAX_PAGED_MODULE_CUDA defined, as `_cuda`.
#include <nanobind/nanobind.h>

#include "ffi/handlers.h"
#include "sizes.h"
#ifdef JAX_PAGED_MODULE_CUDA
#include "cuda/options.h"
#else
#include "cpu/parallel.h"
#endif

namespace nb = nanobind;

#ifdef JAX_PAGED_MODULE_CUDA
#define JAX_PAGED_MODULE_NAME _cuda
#define JAX_PAGED_HANDLER(name) name##Cuda
#else
#define JAX_PAGED_MODULE_NAME _cpu
#define JAX_PAGED_HANDLER(name) name##Cpu
#endif

template <typename Fn>
static nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// A size list of sizes.h as a Python tuple.
#define JAX_PAGED_APPEND_SIZE(list, size) list.append(size);
#define JAX_PAGED_SIZE_TUPLE(LIST)                \
  [] {                                            \
    nb::list sizes;                               \
    LIST(JAX_PAGED_APPEND_SIZE, sizes)            \
    return nb::tuple(sizes);                      \
  }()

NB_MODULE(JAX_PAGED_MODULE_NAME, m) {
  m.attr("jaxlib_build_version") = JAXLIB_BUILD_VERSION;
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  // The sizes the CUDA kernels are instantiated for and the bounds every kernel
  // shares (sizes.h); jax_paged/_shapes.py reads them from here.
  m.attr("head_sizes") = JAX_PAGED_SIZE_TUPLE(JAX_PAGED_HEAD_SIZES);
  m.attr("fp8_head_sizes") = JAX_PAGED_SIZE_TUPLE(JAX_PAGED_FP8_HEAD_SIZES);
  m.attr("block_sizes") = JAX_PAGED_SIZE_TUPLE(JAX_PAGED_BLOCK_SIZES);
  m.attr("max_head_size") = jax_paged::kMaxHeadSize;
  m.attr("max_block_size") = jax_paged::kMaxBlockSize;
#ifndef JAX_PAGED_MODULE_CUDA
  // Worker threads of the CPU kernels (JAX_PAGED_CPU_THREADS, else the cores
  // this process may use), read once per process.
  m.def("cpu_threads", &jax_paged::cpu::AvailableThreads);
#endif
  m.def("registrations", []() {
    nb::dict d;
    d["jax_paged_attention_v1"] = Capsule(JAX_PAGED_HANDLER(JaxPagedAttentionV1));
    d["jax_paged_attention_v2"] = Capsule(JAX_PAGED_HANDLER(JaxPagedAttentionV2));
    d["jax_paged_reshape_and_cache"] = Capsule(JAX_PAGED_HANDLER(JaxPagedReshapeAndCache));
    d["jax_paged_copy_blocks"] = Capsule(JAX_PAGED_HANDLER(JaxPagedCopyBlocks));
#ifdef JAX_PAGED_MODULE_CUDA
    // CUDA only: on the CPU, impl="grouped" lowers to the (already grouped) V2 target.
    d["jax_paged_attention_grouped"] = Capsule(JaxPagedAttentionGroupedCuda);
#endif
    return d;
  });
#ifdef JAX_PAGED_MODULE_CUDA
  m.def("grouped_ctas_per_sm", &JaxPagedGroupedCtasPerSm, nb::arg("query_itemsize"),
        nb::arg("cache_itemsize"), nb::arg("head_size"), nb::arg("rows_per_kv_head"),
        nb::arg("q_len"), nb::arg("seq_kv_heads"));
  m.def("grouped_rows_per_cta", &JaxPagedGroupedRowsPerCta, nb::arg("query_itemsize"),
        nb::arg("cache_itemsize"), nb::arg("head_size"), nb::arg("rows_per_kv_head"),
        nb::arg("q_len"), nb::arg("seq_kv_heads"));
  m.attr("development_options") = JaxPagedDevelopmentOptions();
  // The kernel-form options this process runs with (JAX_PAGED_DEV_OPTIONS over the
  // defaults), so that a test can tell which form its calls took.
  m.def("kernel_options", []() {
    const jax_paged::cuda::KernelOptions& o = jax_paged::cuda::GetKernelOptions();
    nb::dict d;
    d["row_split"] = o.row_split;
    d["wgmma"] = o.wgmma;
    d["wgmma_128"] = o.wgmma_128;
    d["half_rows"] = o.half_rows;
    d["fp8_ctas"] = o.fp8_ctas;
    d["pdl"] = o.pdl;
    d["portable"] = o.portable;
    return d;
  });
#ifdef JAX_PAGED_TRACE
  m.def("set_grouped_trace", &JaxPagedSetGroupedTrace, nb::arg("buffer"), nb::arg("capacity_ctas"));
#endif
#endif
}
