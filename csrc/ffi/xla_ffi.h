// The XLA FFI API header, included quietly: it trips a few harmless nvcc/gcc
// warnings (missing return after an exhaustive switch, always_inline on
// templates); keeping them out lets our own warnings stand out.
#pragma once

#ifdef __CUDACC__
#pragma nv_diag_suppress 940
#pragma nv_diag_suppress 2473
#endif
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop
#ifdef __CUDACC__
#pragma nv_diag_default 940
#pragma nv_diag_default 2473
#endif
