// Checks the CPU kernel's tile products (cuda/cpu/cpu_tiles.h) against float64
// loops on random data, for whatever instruction set this file is compiled for:
// tests/test_cpu_tiles.py builds it with -DJAX_PAGED_CPU_NO_CLONES and each of
// -march=x86-64 / x86-64-v3 / x86-64-v4 the machine can run, so that every
// variant the library's function multi-versioning may pick is exercised.
// Also the fp8 decoding tables (cpu_scalar.h) against the formats' definition.
// Prints one line per check; exits 1 if any error is over its bound.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/cpu_scalar.h"
#include "cpu/cpu_tiles.h"

using namespace jax_paged::cpu;

namespace {

int failures = 0;

void Report(const char* what, double err, double bound) {
  const bool ok = err <= bound;  // false for NaN
  std::printf("%-40s max error %.3g (bound %.3g) %s\n", what, err, bound, ok ? "ok" : "FAILED");
  if (!ok) ++failures;
}

// Codes whose table value differs from the format's definition (sign, EXP
// exponent bits with bias 2^(EXP-1) - 1, MAN mantissa bits; FN: e4m3fn, no
// infinities, NaN only at the all-ones code; else IEEE-like). NaN must be NaN.
template <int EXP, int MAN, bool FN>
int Fp8TableMismatches() {
  const int bias = (1 << (EXP - 1)) - 1, top = (1 << EXP) - 1;
  int bad = 0;
  for (int code = 0; code < 256; ++code) {
    const int e = (code >> MAN) & top, m = code & ((1 << MAN) - 1);
    double want;
    if (FN ? (e == top && m == (1 << MAN) - 1) : (e == top && m != 0)) {
      want = NAN;
    } else if (!FN && e == top) {
      want = INFINITY;
    } else {
      want = e == 0 ? std::ldexp(m, 1 - bias - MAN) : std::ldexp((1 << MAN) + m, e - bias - MAN);
    }
    if (code & 0x80) want = -want;
    const float got = Fp8Format<EXP, MAN, FN>::kTable.v[code];
    const bool same = std::isnan(want) ? std::isnan(got)
                                       : (got == want && std::signbit(got) == std::signbit(want));
    bad += same ? 0 : 1;
  }
  return bad;
}

}  // namespace

// LogitsTile / ValuesTile (kRows = kRowTile) or LogitsRow / ValuesRow (kRows =
// 1) against float64 loops; the buffers' other rows must stay untouched.
template <int kRows>
void CheckTiles(std::mt19937& rng, int dims) {
  std::normal_distribution<float> normal;
  const int stride = (dims + kDimTile - 1) / kDimTile * kDimTile;
  std::vector<float> q(kRowTile * stride), kd(dims * kChunk), vt(kChunk * stride);
  std::vector<float> p(kRowTile * kChunk), acc(kRowTile * stride);
  for (auto& v : q) v = normal(rng);
  for (auto& v : kd) v = normal(rng);
  for (auto& v : vt) v = normal(rng);
  for (auto& v : p) v = std::fabs(normal(rng));
  for (auto& v : acc) v = normal(rng);
  // Logits over tokens [16, 48): the rest of s must stay untouched.
  std::vector<float> s(kRowTile * kChunk, 12345.0f);
  if constexpr (kRows == 1)
    LogitsRow(q.data(), kd.data(), dims, 16, 48, s.data());
  else
    LogitsTile(q.data(), stride, kd.data(), dims, 16, 48, s.data());
  double err = 0;
  for (int r = 0; r < kRowTile; ++r)
    for (int t = 0; t < kChunk; ++t) {
      double want = 12345.0;
      if (r < kRows && t >= 16 && t < 48) {
        want = 0;
        for (int d = 0; d < dims; ++d) want += double(q[r * stride + d]) * kd[d * kChunk + t];
      }
      err = std::fmax(err, std::fabs(s[r * kChunk + t] - want) / std::sqrt(double(dims)));
    }
  char name[64];
  std::snprintf(name, sizeof name, "%s dims %d", kRows == 1 ? "LogitsRow" : "LogitsTile", dims);
  Report(name, err, 1e-5);
  // P.V over tokens [5, 61), added to acc.
  std::vector<double> want(acc.begin(), acc.end());
  for (int r = 0; r < kRows; ++r)
    for (int t = 5; t < 61; ++t)
      for (int d = 0; d < stride; ++d)
        want[r * stride + d] += double(p[r * kChunk + t]) * vt[t * stride + d];
  if constexpr (kRows == 1)
    ValuesRow(p.data(), vt.data(), stride, stride, 5, 61, acc.data());
  else
    ValuesTile(p.data(), vt.data(), stride, stride, 5, 61, acc.data());
  err = 0;
  for (size_t i = 0; i < acc.size(); ++i) err = std::fmax(err, std::fabs(acc[i] - want[i]) / 8.0);
  std::snprintf(name, sizeof name, "%s dims %d", kRows == 1 ? "ValuesRow" : "ValuesTile", dims);
  Report(name, err, 1e-5);
}

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (int dims : {8, 40, 72, 128, 256}) {
    CheckTiles<kRowTile>(rng, dims);
    CheckTiles<1>(rng, dims);
  }
  // exp(x - m) and its sum over a row of logits with masked (-inf) tokens.
  std::vector<float> row(kChunk);
  for (int i = 0; i < kChunk; ++i) row[i] = i % 7 == 3 ? -INFINITY : 20.0f * normal(rng);
  float m = -INFINITY;
  for (float v : row) m = std::fmax(m, v);
  std::vector<float> got = row;
  const float sum = ExpShiftedSum(got.data(), 3, 59, m);
  double rel = 0, want_sum = 0, untouched = 0;
  for (int i = 0; i < kChunk; ++i) {
    if (i < 3 || i >= 59) {
      if (!(got[i] == row[i])) untouched = 1;
      continue;
    }
    const double want = std::exp(double(row[i] - m));  // the difference rounded to float, as the kernel has it
    want_sum += want;
    // exp below e^-87.33 (subnormal in float) is flushed to 0: absolute error there.
    rel = std::fmax(rel, std::fabs(got[i] - want) / std::fmax(want, 1e-30));
  }
  Report("ExpShiftedSum values (relative)", rel, 2e-7);
  Report("ExpShiftedSum sum (relative)", std::fabs(sum - want_sum) / want_sum, 1e-6);
  Report("ExpShiftedSum leaves other tokens", untouched, 0);
  // Dense sweep of the exponential itself, and its special values.
  double worst = 0;
  for (float x = -87.3f; x <= 0.0f; x += 1.0e-4f) {
    const double want = std::exp(double(x));
    worst = std::fmax(worst, std::fabs(ExpNonPositive(x) - want) / want);
  }
  Report("ExpNonPositive on [-87.3, 0] (relative)", worst, 2e-7);
  const bool special = ExpNonPositive(-INFINITY) == 0.0f && std::isnan(ExpNonPositive(NAN)) &&
                       ExpNonPositive(0.0f) == 1.0f && ExpNonPositive(-100.0f) == 0.0f;
  Report("ExpNonPositive(-inf, NaN, 0, -100)", special ? 0 : 1, 0);
  // The fp8 decoding tables (built at compile time) against the formats' definition.
  Report("fp8 e4m3 table: codes off (of 256)", Fp8TableMismatches<4, 3, true>(), 0);
  Report("fp8 e5m2 table: codes off (of 256)", Fp8TableMismatches<5, 2, false>(), 0);
  return failures ? 1 : 0;
}
