// Run-time choices between kernel forms that compute the same results. Each
// default is the form the library runs; the others exist for A/B timing within
// one build and as escape hatches. They are read once per process from the
// development variable JAX_PAGED_DEV_OPTIONS, a comma-separated list of
// name=value, e.g. JAX_PAGED_DEV_OPTIONS=row_split=0,fp8_ctas=2.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace jax_paged {
namespace cuda {

struct KernelOptions {
  // Multi-token queries with more than 16 rows per KV head: CTAs of 32 or 64 rows
  // (grouped_launch.h, RowBlocks) instead of 16-row CTAs that each read the pages.
  bool row_split = true;
  // The row split's 64-row CTAs on warpgroup products (compute capability 9.0).
  bool wgmma = true;
  // With wgmma, more than 64 rows per KV head in 128-row CTAs (two warpgroups).
  bool wgmma_128 = true;
  // The plain decode step's kernel for CTAs of at most 8 query rows.
  bool half_rows = true;
  // CTAs per SM of the fp8 decode kernels with 16 KB stages: 0, the per-call rule
  // (grouped_launch.h, Fp8CtasFor); 2 or 4, that count for every call.
  int fp8_ctas = 0;
  // The V2 reduce launched as a programmatic dependent of the attention kernel (sm_90+).
  bool pdl = true;
  // impl="grouped" on the portable (sm_80) kernel on every GPU, Hopper included: how
  // the GPU suite tests the Ampere / Ada path on an H100 or H200.
  bool portable = false;
};

constexpr const char* kKernelOptionsVariable = "JAX_PAGED_DEV_OPTIONS";
constexpr const char* kKernelOptionsAccepted =
    "row_split, wgmma, wgmma_128, half_rows, pdl, portable (0 or 1), fp8_ctas (0, 2 or 4)";

// Applies one "name=value" entry to `o`. Returns nullptr, or what is wrong with the
// entry (`o` then as it was): no '=', an unknown name, or a value the name does not take.
inline const char* ApplyKernelOption(const std::string& entry, KernelOptions& o) {
  const size_t eq = entry.find('=');
  if (eq == std::string::npos) return "not name=value";
  const std::string name = entry.substr(0, eq);
  const std::string value = entry.substr(eq + 1);
  if (name == "fp8_ctas") {
    if (value != "0" && value != "2" && value != "4") return "value not 0, 2 or 4";
    o.fp8_ctas = value[0] - '0';
    return nullptr;
  }
  bool* flag = name == "row_split"   ? &o.row_split
               : name == "wgmma"     ? &o.wgmma
               : name == "wgmma_128" ? &o.wgmma_128
               : name == "half_rows" ? &o.half_rows
               : name == "pdl"       ? &o.pdl
               : name == "portable"  ? &o.portable
                                     : nullptr;
  if (flag == nullptr) return "unknown name";
  if (value != "0" && value != "1") return "value not 0 or 1";
  *flag = value == "1";
  return nullptr;
}

// The options `text` sets over the defaults (nullptr: none). Blanks around an entry
// are ignored, and so are empty entries; each bad entry is reported as one line on
// `err` (when not nullptr) and skipped.
inline KernelOptions ParseKernelOptions(const char* text, std::FILE* err) {
  KernelOptions o;
  if (text == nullptr) return o;
  const std::string s(text);
  size_t begin = 0;
  while (begin <= s.size()) {
    size_t end = s.find(',', begin);
    if (end == std::string::npos) end = s.size();
    size_t a = begin, b = end;
    while (a < b && (s[a] == ' ' || s[a] == '\t')) ++a;
    while (b > a && (s[b - 1] == ' ' || s[b - 1] == '\t')) --b;
    const std::string entry = s.substr(a, b - a);
    if (!entry.empty()) {
      const char* problem = ApplyKernelOption(entry, o);
      if (problem != nullptr && err != nullptr)
        std::fprintf(err, "jax_paged: %s: ignoring '%s' (%s); accepted: %s\n",
                     kKernelOptionsVariable, entry.c_str(), problem, kKernelOptionsAccepted);
    }
    begin = end + 1;
  }
  return o;
}

// The process's options, parsed from JAX_PAGED_DEV_OPTIONS at the first call.
inline const KernelOptions& GetKernelOptions() {
  static const KernelOptions options =
      ParseKernelOptions(std::getenv(kKernelOptionsVariable), stderr);
  return options;
}

}  // namespace cuda
}  // namespace jax_paged
