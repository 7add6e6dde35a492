#!/usr/bin/env bash
# A/B of a CMake development option in one device call, from the repository root:
#
#     AB_CMAKE_ARGS="-DJAX_PAGED_<NAME>=ON" bash dev/ab_build.sh
#
# Builds the default kernels (A: -DJAX_PAGED_DEV=OFF) and a development build with
# AB_CMAKE_ARGS (B: -DJAX_PAGED_DEV=ON, the options of dev/CMakeLists.txt). CMake keeps a
# cached option until it is set again, so every build first passes every option of
# dev/CMakeLists.txt and every -DNAME=... of AB_CMAKE_ARGS and AB_CMAKE_ARGS_C as
# -DNAME=OFF (only ON/OFF options fit); with each build
# runs the GPU tests selected by AB_TESTS (B only by default: A is what gpu_check tests) and
# the benchmark with AB_BENCH_ARGS; prints both benchmark summaries, B then A, each with
# its own same-run copy bandwidth. Leaves the default build (A) installed. With
# AB_CMAKE_ARGS_C set, a third build C (A's options overridden by AB_CMAKE_ARGS_C,
# e.g. B less one option, to attribute B's gain) runs between B and A (tested with AB_TEST_C=1).
#
# Environment: OUT (results: a.json b.json [c.json], logs; default ./out/ab), PYTHON (python3),
#   AB_CMAKE_ARGS (required), AB_BENCH_ARGS (default: the B=1 and 8x8 rows at 32k and 8k tokens,
#   no Pallas, no reference), AB_TESTS (default "-q -k 'gpu and grouped'"; empty: none),
#   AB_TEST_A=1 to test build A too, AB_TEST_B=0 not to test build B, AB_TEST_JOBS (concurrent
#   test shards, default 4: dev/sharded_pytest.py), AB_DRY_RUN=1 to print the three builds'
#   CMake arguments and stop.
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
OUTDIR=${OUT:-$PWD/out/ab}
: "${AB_CMAKE_ARGS:?set AB_CMAKE_ARGS, e.g. -DJAX_PAGED_TRACE=ON}"
BENCH_ARGS=${AB_BENCH_ARGS:---no-defaults --config 1,32,8,32768 --config 8,32,8,8192 --no-pallas --no-reference}
TESTS=${AB_TESTS-"-q -k 'gpu and grouped'"}
AB_TEST_JOBS=${AB_TEST_JOBS:-4}
# Every development option and every option named by B or C, OFF: CMake keeps a cached
# option until it is set again, so each build switches off what an earlier build (of this
# call or of an earlier one on a warm machine) switched on. The last -D of a name wins.
off_args() { sed -E 's/-D([A-Za-z0-9_]+)(:[A-Z]+)?=[^ ]*/-D\1=OFF/g' <<< "$1"; }
DEV_OPTIONS_OFF=$(sed -nE 's/^ *option\((JAX_PAGED_[A-Z0-9_]+) .*/-D\1=OFF/p' dev/CMakeLists.txt | paste -sd' ')
OFF_ARGS="$DEV_OPTIONS_OFF $(off_args "$AB_CMAKE_ARGS ${AB_CMAKE_ARGS_C:-}")"
A_CMAKE_ARGS="$OFF_ARGS -DJAX_PAGED_DEV=OFF"
B_CMAKE_ARGS="$OFF_ARGS -DJAX_PAGED_DEV=ON $AB_CMAKE_ARGS"
C_CMAKE_ARGS=""
[ -n "${AB_CMAKE_ARGS_C:-}" ] && C_CMAKE_ARGS="$OFF_ARGS -DJAX_PAGED_DEV=ON $AB_CMAKE_ARGS_C"
if [ -n "${AB_DRY_RUN:-}" ]; then  # print the builds' CMake arguments only (dev/tests/test_scripts.py)
  printf 'B=%s\nC=%s\nA=%s\n' "$B_CMAKE_ARGS" "$C_CMAKE_ARGS" "$A_CMAKE_ARGS"
  exit 0
fi
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
FAILED=0

install() {  # $1: label, $2: CMAKE_ARGS
  echo "=== [$1] install (CMAKE_ARGS=\"$2\")"
  if ! CMAKE_ARGS="$2" "$PY" -m pip install --no-build-isolation --no-deps -e . -v \
      > "$OUTDIR/install_$1.log" 2>&1; then
    tail -n 30 "$OUTDIR/install_$1.log"
    return 1
  fi
}

run_side() {  # $1: label (a or b), $2: CMAKE_ARGS, $3: run the tests (0/1)
  install "$1" "$2" || { echo "=== [$1] install FAILED"; FAILED=1; return; }
  if [ "$3" = 1 ] && [ -n "$TESTS" ]; then
    echo "=== [$1] tests: pytest $TESTS tests ($AB_TEST_JOBS shards)"
    eval "timeout -k 15 420 \"$PY\" dev/sharded_pytest.py --jobs $AB_TEST_JOBS \
      --log-dir \"$OUTDIR\" -- $TESTS tests" > "$OUTDIR/tests_$1.log" 2>&1 || FAILED=1
    tail -n 3 "$OUTDIR/tests_$1.log"
  fi
  echo "=== [$1] bench $BENCH_ARGS"
  # shellcheck disable=SC2086
  timeout -k 15 420 "$PY" benchmarks/bench_paged_attention.py $BENCH_ARGS --no-progress \
    --json "$OUTDIR/$1.json" --png "$OUTDIR/$1.png" > "$OUTDIR/bench_$1.log" 2>&1 || FAILED=1
  sed -n '/^config .*kv MB/,$p' "$OUTDIR/bench_$1.log"
}

# B first, so that A, the default kernels, stays installed.
run_side b "$B_CMAKE_ARGS" "${AB_TEST_B:-1}"
[ -n "$C_CMAKE_ARGS" ] && run_side c "$C_CMAKE_ARGS" "${AB_TEST_C:-0}"
run_side a "$A_CMAKE_ARGS" "${AB_TEST_A:-0}"
echo
echo "ab_build: A = $A_CMAKE_ARGS, B = $AB_CMAKE_ARGS${C_CMAKE_ARGS:+, C = $C_CMAKE_ARGS};" \
  "$([ "$FAILED" = 0 ] && echo "all steps ok" || echo "SOME STEPS FAILED")"
exit "$FAILED"
