#!/usr/bin/env bash
# One command for the GPU machine, from the repository root:
#
#     bash dev/gpu_check.sh
#
# Stages (each runs even when an earlier one failed; the exit status is non-zero
# when any stage that ran failed, and 3 when ONLY_ON names another card, before any stage):
#   1. install   python3 -m pip install --no-build-isolation --no-deps -e .   (builds the CUDA module;
#                the default build, -DJAX_PAGED_DEV=OFF, unless CMAKE_ARGS, CEILING or FLOOR
#                asks for a development build)
#   2. env       GPU name (nvidia-smi), jax version, jax.devices(), nvcc, jax_paged CUDA kernels
#   3. tests     python3 -m pytest -q -k gpu tests   (the GPU cases; CPU cases run in CI), as
#                TEST_JOBS concurrent shards (dev/sharded_pytest.py; the suite is
#                compile-bound, so shards run side by side)
#   3b. wheel    with WHEEL=1: python3 -m pip wheel --no-build-isolation --no-deps -w OUT/wheel .
#                (the install stage's CMake arguments and build directory), installed into a
#                fresh environment; fails if ldd lists libcudart / libcuda for its CUDA module;
#                then wheel_tests: the tests stage's selection with that environment's python,
#                from copies of tests/, examples/ and benchmarks/ outside this tree
#   4. sanitizer compute-sanitizer --tool memcheck over dev/sanitizer_case.py
#   5. bench     benchmarks/bench_paged_attention.py (JSON + PNG)
#   5b. decode   with DECODE_VARIANTS set: examples/generate.py once per variant
#   6. summary   printed last, also written to summary.txt
#   7. bundle    with BUNDLE=1: every other file of OUT packed into OUT/bundle.tar.gz (the
#                device tool returns only a few files of OUT)
#
# Environment:
#   OUT              where logs and results go (the device tool sets it; default ./out/gpu_check).
#                    Files written there (flat, but for wheel/): install.log tests.log sanitizer.log
#                    bench.log bench.json bench.png summary.txt sources.sha256 wheel.log
#                    wheel_tests.log wheel/*.whl (the test shards' own logs go to out/test_shards/
#                    and out/wheel_test_shards/; tests.log has the end of any failed shard's log)
#   PYTHON           interpreter (default python3)
#   CMAKE_ARGS       for the install, after -DJAX_PAGED_DEV=OFF (see the install stage); a
#                    development build names -DJAX_PAGED_DEV=ON and its options (dev/CMakeLists.txt),
#                    e.g. CMAKE_ARGS="-DJAX_PAGED_DEV=ON -DJAX_PAGED_PROBE_NO_LOADS=ON"
#   SKIP_INSTALL=1 SKIP_TESTS=1 SKIP_SANITIZER=1 SKIP_BENCH=1   skip a stage
#   CEILING=1        also run dev/wgmma_ceiling.cu as the install built it (after the env
#                    stage; output in ceiling.log; the install then builds with
#                    -DJAX_PAGED_DEV=ON, which compiles it; CEILING_BIN overrides the binary's path)
#   FLOOR="REPS [MODE]"  also run dev/read_floor.cu as the install built it, with these
#                    arguments (e.g. FLOOR="15 cluster"; after the env stage; output in
#                    floor.log; -DJAX_PAGED_DEV=ON as for CEILING; FLOOR_BIN overrides the
#                    binary's path)
#   BENCH_ARGS       extra benchmark arguments, e.g. BENCH_ARGS="--config 16,40,8,4096 --reps 9"
#   BENCH_ENVS       ';'-separated environment assignments: the bench stage runs once per
#                    entry (stages bench_1, bench_2, ...; bench_<i>.json in OUT), e.g.
#                    BENCH_ENVS="JAX_PAGED_DEV_OPTIONS=pdl=1;JAX_PAGED_DEV_OPTIONS=pdl=0"
#   PYTEST_ARGS      default "-q -k gpu" (the GPU cases; the CPU cases run in CI); split on spaces
#   PYTEST_K         instead of PYTEST_ARGS: one -k expression, spaces allowed, e.g.
#                    PYTEST_K="gpu and (multi_token or many_query_rows)"
#   TEST_JOBS        concurrent pytest processes for the tests stage (default 4; 1 = one
#                    plain pytest run)
#   SANITIZER_TOOL   compute-sanitizer tool (default memcheck; racecheck / synccheck / initcheck
#                    are slower: narrow the case with SANITIZER_CASE_ARGS; racecheck flags the
#                    decode kernels' count-based stage release, which it cannot model: only a
#                    hazard in a row-split kernel is a finding, see docs/development.md)
#   SANITIZER_CASE_ARGS  arguments of dev/sanitizer_case.py, e.g.
#                    "--impls grouped --head-sizes 256 --no-cache-ops"
#   SANITIZER_RUNS   runs of the sanitizer stage at most, while compute-sanitizer itself crashes
#                    (exit >= 128 with no summary line; default 5)
#   SANITIZER_ARGS   extra compute-sanitizer arguments (default "--report-api-errors no":
#                    XLA's own probing calls return CUDA errors by design; a failed launch
#                    of ours surfaces as a Python exception and fails the case anyway)
#   DECODE_VARIANTS  ';'-separated argument sets of examples/generate.py, each added to DECODE_ARGS:
#                    the decode stage runs the example once per set (stages decode_1, decode_2, ...;
#                    decode_<i>.json in OUT), e.g. (a bf16 cache against an fp8 one, same requests)
#                    DECODE_VARIANTS="--kv-cache-dtype model;--kv-cache-dtype float8_e4m3fn"
#   DECODE_ARGS      arguments common to every decode variant (default: the Llama-3-8B shapes with
#                    4 layers, 32 requests of 1000-2000 prompt tokens, 128 new tokens each)
#   WHEEL=1          run the wheel and wheel_tests stages (JAX_PAGED_CUDA defaults to ON there)
#   BUNDLE=1         pack OUT's files except summary.txt into OUT/bundle.tar.gz at the end
#   ONLY_ON=NAME     run no stage unless nvidia-smi's first GPU name contains NAME (e.g.
#                    ONLY_ON=H200): otherwise say so in summary.txt and exit 3 at once. (A call
#                    for an H200 may be given an H100; a card-specific run then costs only the
#                    machine's start, not an install and a suite whose figures do not compare.)
#   INSTALL_TIMEOUT TESTS_TIMEOUT SANITIZER_TIMEOUT BENCH_TIMEOUT CEILING_TIMEOUT FLOOR_TIMEOUT DECODE_TIMEOUT
#   WHEEL_TIMEOUT    seconds per stage (defaults 420 / 540 / 240 / 420 / 120 / 300 / 240 / 600;
#                    wheel_tests has TESTS_TIMEOUT)
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
OUTDIR=${OUT:-$ROOT/out/gpu_check}
mkdir -p "$OUTDIR"
SUMMARY=$OUTDIR/summary.txt
export PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 4)}

STAGES=()
declare -A RESULT DETAIL SECONDS_TAKEN

now() { date -u +%Y-%m-%dT%H:%M:%SZ; }

# Kills every process whose environment holds GPU_CHECK_STAGE=$1: what a stage left
# running. By environment, not by command line: a command-line match would also kill a
# concurrent GPU test's own run of the same script.
kill_stage_leftovers() {
  local env_file pid
  for env_file in /proc/[0-9]*/environ; do
    pid=${env_file#/proc/}
    pid=${pid%/environ}
    [ "$pid" = $$ ] && continue
    grep -qzx "GPU_CHECK_STAGE=$1" "$env_file" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  done
  return 0
}

# run_stage NAME LOGFILE TIMEOUT_S CMD...  -> output to LOGFILE, then to the terminal.
# Not through a pipe: a process the timeout does not reach (compute-sanitizer's
# target runs in its own process group) would hold the pipe open and hang the
# script; processes the stage's command started and left running are killed
# (each stage's processes carry a token of their own in GPU_CHECK_STAGE).
run_stage() {
  local name=$1 log=$2 tmo=$3
  shift 3
  # (A stage run again, e.g. the sanitizer after a crash, keeps its place.)
  [[ " ${STAGES[*]} " == *" $name "* ]] || STAGES+=("$name")
  echo
  echo "=== [$name] $(now): $*"
  local t0=$SECONDS rc token="gpu_check.$$.$name.$RANDOM"
  GPU_CHECK_STAGE=$token timeout -k 15 "$tmo" "$@" > "$log" 2>&1
  rc=$?
  kill_stage_leftovers "$token"
  cat "$log"
  SECONDS_TAKEN[$name]=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then RESULT[$name]=ok; else RESULT[$name]="FAILED (exit $rc)"; fi
  [ "$rc" -eq 124 ] && RESULT[$name]="FAILED (timed out after ${tmo}s)"
  echo "=== [$name] ${RESULT[$name]} in ${SECONDS_TAKEN[$name]}s"
  return "$rc"
}

skip_stage() {
  STAGES+=("$1"); RESULT[$1]="skipped ($2)"; SECONDS_TAKEN[$1]=0
  echo; echo "=== [$1] skipped ($2)"
}

# The sources that make the build (the development build's too), in a locale-independent order.
source_files() {
  { find CMakeLists.txt pyproject.toml csrc jax_paged -type f \( -name '*.txt' -o -name '*.toml' \
      -o -name '*.h' -o -name '*.cuh' -o -name '*.cu' -o -name '*.cc' -o -name '*.py' \)
    find dev -maxdepth 1 -type f \( -name CMakeLists.txt -o -name '*.cu' \); } | LC_ALL=C sort
}

# The device tool copies the working tree, whose .git may lag behind it: the
# sources' hashes (one line per file, to compare with the same list made here)
# and the hash of that list identify what was built.
source_files | xargs sha256sum > "$OUTDIR/sources.sha256"
{
  echo "gpu_check $(now)  repo $ROOT  commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
    " sources $(sha256sum < "$OUTDIR/sources.sha256" | cut -c1-12)"
} | tee "$SUMMARY"

# ---- 0. the card (ONLY_ON) ----------------------------------------------------
if [ -n "${ONLY_ON:-}" ]; then
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  if [[ "$GPU_NAME" != *"$ONLY_ON"* ]]; then
    echo "gpu_check: the GPU is '${GPU_NAME:-none found}', not ONLY_ON=$ONLY_ON: no stage run" \
      | tee -a "$SUMMARY"
    exit 3
  fi
fi

# ---- 1. install ------------------------------------------------------------
if [ "${SKIP_INSTALL:-0}" = 1 ]; then
  skip_stage install SKIP_INSTALL=1
else
  # Quiet on the terminal (the CUDA build is long); full build log in install.log.
  STAGES+=(install)
  # The default build compiles no development code: -DJAX_PAGED_DEV=OFF, explicitly, since a
  # warm machine's build directory keeps a cached option until it is set again. A development
  # build (CMAKE_ARGS asks for one, or CEILING / FLOOR, whose programs only it compiles)
  # first switches every option of dev/CMakeLists.txt off, for the same reason; CMAKE_ARGS
  # comes last (the last -D of a name wins).
  DEV_ARGS=-DJAX_PAGED_DEV=OFF
  if [ "${CEILING:-0}" = 1 ] || [ -n "${FLOOR:-}" ] ||
     [[ "${CMAKE_ARGS:-}" =~ -DJAX_PAGED_DEV(:BOOL)?=(ON|on|1|TRUE|true|YES|yes)( |$) ]]; then
    DEV_ARGS="-DJAX_PAGED_DEV=ON $(sed -nE 's/^ *option\((JAX_PAGED_[A-Z0-9_]+) .*/-D\1=OFF/p' \
      dev/CMakeLists.txt | paste -sd' ')"
  fi
  INSTALL_CMAKE_ARGS="$DEV_ARGS${CMAKE_ARGS:+ $CMAKE_ARGS}"
  echo; echo "=== [install] $(now): CMAKE_ARGS=\"$INSTALL_CMAKE_ARGS\" $PY -m pip install --no-build-isolation --no-deps -e . -v"
  t0=$SECONDS
  CMAKE_ARGS="$INSTALL_CMAKE_ARGS" \
  timeout -k 15 "${INSTALL_TIMEOUT:-420}" "$PY" -m pip install --no-build-isolation --no-deps -e . -v \
    > "$OUTDIR/install.log" 2>&1
  rc=$?
  SECONDS_TAKEN[install]=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then
    RESULT[install]=ok
    grep -E "jax_paged: (building|no CUDA)|XLA FFI headers" "$OUTDIR/install.log" | sed 's/^/  /' | head -5
  else
    RESULT[install]="FAILED (exit $rc)"
    [ "$rc" -eq 124 ] && RESULT[install]="FAILED (timed out)"
    grep -nE "error|Error|ERROR" "$OUTDIR/install.log" | head -40
    tail -n 40 "$OUTDIR/install.log"
  fi
  echo "=== [install] ${RESULT[install]} in ${SECONDS_TAKEN[install]}s (log: $OUTDIR/install.log)"
fi

# ---- 2. environment --------------------------------------------------------
echo; echo "=== [env]"
{
  echo "gpu:      $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4 | paste -sd';')"
  echo "nvcc:     $(nvcc --version 2>/dev/null | tail -n 1 || echo 'not found')"
  "$PY" - <<'EOF' 2>&1
import platform
try:
    import jax, jaxlib
    print(f"python:   {platform.python_version()}  jax {jax.__version__}  jaxlib {jaxlib.__version__}")
    print(f"devices:  {jax.devices()}")
except Exception as e:
    print(f"jax:      FAILED {type(e).__name__}: {e}")
try:
    import jax_paged
    print(f"jax_paged: {jax_paged.__file__}  cuda kernels: {jax_paged.has_cuda_kernels()}")
except Exception as e:
    print(f"jax_paged: import FAILED {type(e).__name__}: {e}")
EOF
} | tee -a "$SUMMARY"

# A development program the install built (the newest build/*/dev/NAME, or BIN when set),
# run as stage STAGE (log OUT/STAGE.log) with ARGS; a missing binary fails the stage.
run_built_program() {
  local stage=$1 name=$2 bin=$3 tmo=$4
  shift 4
  [ -n "$bin" ] || bin=$(ls -t build/*/dev/"$name" 2>/dev/null | head -n 1)
  if [ -z "$bin" ]; then
    STAGES+=("$stage")
    RESULT[$stage]="FAILED (build/*/dev/$name not found: it needs a -DJAX_PAGED_DEV=ON build)"
    echo; echo "=== [$stage] ${RESULT[$stage]}"
    return 1
  fi
  run_stage "$stage" "$OUTDIR/$stage.log" "$tmo" "$bin" "$@"
  local rc=$?
  DETAIL[$stage]="$bin${*:+ $*}"
  return "$rc"
}

# ---- 2b. the warpgroup-product ceiling (CEILING=1) --------------------------
# dev/wgmma_ceiling.cu as the install built it: a few seconds; its own checks, then its
# timings (docs/development.md).
if [ "${CEILING:-0}" = 1 ]; then
  run_built_program ceiling jax_paged_wgmma_ceiling "${CEILING_BIN:-}" "${CEILING_TIMEOUT:-120}"
  if [ -n "${DETAIL[ceiling]:-}" ]; then  # (it ran, passed or not)
    DETAIL[ceiling]+="; checks: $(grep -c ': ok$' "$OUTDIR/ceiling.log") ok, $(grep -c 'WRONG$' "$OUTDIR/ceiling.log") wrong"
  fi
fi

# ---- 2c. the bare paged read's floor (FLOOR="REPS [MODE]") -------------------
# dev/read_floor.cu as the install built it, FLOOR's words as its arguments: seconds to
# a few minutes (docs/development.md).
if [ -n "${FLOOR:-}" ]; then
  # shellcheck disable=SC2086  # FLOOR is a list of arguments
  run_built_program floor jax_paged_read_floor "${FLOOR_BIN:-}" "${FLOOR_TIMEOUT:-300}" $FLOOR
fi

# ---- 3. tests --------------------------------------------------------------
if [ "${SKIP_TESTS:-0}" = 1 ]; then
  skip_stage tests SKIP_TESTS=1
else
  # PYTEST_K: one -k expression, spaces allowed (PYTEST_ARGS is split on spaces).
  # shellcheck disable=SC2206
  if [ -n "${PYTEST_K:-}" ]; then PT_ARGS=(-q -k "$PYTEST_K"); else PT_ARGS=(${PYTEST_ARGS:--q -k gpu}); fi
  if [ "${TEST_JOBS:-4}" -gt 1 ]; then
    run_stage tests "$OUTDIR/tests.log" "${TESTS_TIMEOUT:-540}" "$PY" dev/sharded_pytest.py \
      --jobs "${TEST_JOBS:-4}" --log-dir "$ROOT/out/test_shards" -- "${PT_ARGS[@]}" tests
  else
    run_stage tests "$OUTDIR/tests.log" "${TESTS_TIMEOUT:-540}" "$PY" -m pytest "${PT_ARGS[@]}" tests
  fi
  DETAIL[tests]=$(grep -E "[0-9]+ (passed|failed|errors?|skipped)|no tests ran" "$OUTDIR/tests.log" | tail -n 1 | sed 's/=//g; s/^ *//')
  [ -z "${DETAIL[tests]}" ] && DETAIL[tests]="no pytest summary line; last: $(tail -n 1 "$OUTDIR/tests.log" | cut -c1-100)"
fi

# ---- 3b. wheel (WHEEL=1) -----------------------------------------------------
# The wheel a user would install: built from this tree (the install stage's build directory
# and CMake arguments, so a warm build is reused), installed into a fresh environment, its
# CUDA module's libraries listed (the static CUDA runtime: no libcudart / libcuda), and the
# GPU cases run there from copies of tests/, examples/ and benchmarks/ outside this tree.
# Not `venv --system-site-packages`: that runs the system site's .pth files, among them the
# editable install's import hook, which would take `jax_paged` back to this source tree; a
# .pth of the interpreter's site directories adds them (jax, pytest) after the wheel's copy
# without running their .pth files.
if [ "${WHEEL:-0}" = 1 ]; then
  WHEEL_WORK=$(mktemp -d "${TMPDIR:-/tmp}/jax_paged_wheel.XXXXXX")
  WHEEL_SCRIPT=$(cat <<'EOF'
set -e -o pipefail
rm -rf "$WHEEL_DIR" && mkdir -p "$WHEEL_DIR"
echo "--- CMAKE_ARGS=\"$CMAKE_ARGS\" JAX_PAGED_CUDA=$JAX_PAGED_CUDA $PY -m pip wheel --no-build-isolation --no-deps -w $WHEEL_DIR ."
"$PY" -m pip wheel --no-build-isolation --no-deps -w "$WHEEL_DIR" .
whl=$(ls "$WHEEL_DIR"/jax_paged-*.whl)
"$PY" -m venv --without-pip "$WHEEL_WORK/venv"
vpy=$WHEEL_WORK/venv/bin/python
purelib=$("$vpy" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$PY" -c 'import os, site, sysconfig
dirs = site.getsitepackages() + [site.getusersitepackages(), sysconfig.get_path("purelib")]
print("\n".join(dict.fromkeys(d for d in dirs if os.path.isdir(d))))' > "$purelib/outer_site.pth"
# The interpreter's own pip, run by the new one, installs into the new environment;
# --ignore-installed leaves the editable install it also sees alone.
"$vpy" -m pip install --no-deps --no-index --ignore-installed --no-warn-script-location "$whl"
so=$(ls "$purelib"/jax_paged/_cuda*.so)
echo "--- ldd $so"
ldd "$so"
if ldd "$so" | grep -E 'libcudart|libcuda\.so|not found'; then
  echo "wheel: the CUDA module needs the libraries above (expected the static CUDA runtime)"; exit 1
fi
cd "$WHEEL_WORK"
"$vpy" - "$WHEEL_WORK" <<'PYEOF'
import os, sys
import jax_paged, jax_paged._cuda
for m in (jax_paged, jax_paged._cuda):
    where = os.path.realpath(m.__file__)
    if not where.startswith(os.path.realpath(sys.argv[1]) + os.sep):
        raise SystemExit(f"wheel: {m.__name__} imported from {where}, expected under {sys.argv[1]}")
if not jax_paged.has_cuda_kernels():
    raise SystemExit("wheel: has_cuda_kernels() is False in the wheel's environment")
print("wheel: jax_paged", jax_paged.__file__, "cuda kernels: True")
PYEOF
EOF
)
  PYTHONPATH='' WHEEL_DIR="$OUTDIR/wheel" WHEEL_WORK="$WHEEL_WORK" PY="$PY" \
  JAX_PAGED_CUDA=${JAX_PAGED_CUDA:-ON} CMAKE_ARGS="${INSTALL_CMAKE_ARGS:--DJAX_PAGED_DEV=OFF}" \
    run_stage wheel "$OUTDIR/wheel.log" "${WHEEL_TIMEOUT:-600}" bash -c "$WHEEL_SCRIPT"
  wheel_rc=$?
  DETAIL[wheel]="$(ls "$OUTDIR"/wheel/*.whl 2>/dev/null | head -n 1); CUDA module needs: $(
    grep -oE '^\s*lib[^ ]+\.so[^ ]*' "$OUTDIR/wheel.log" | tr -d '\t ' | paste -sd' ')"
  if [ "$wheel_rc" -eq 0 ]; then
    mkdir -p "$WHEEL_WORK/src"
    cp -r tests examples benchmarks "$WHEEL_WORK/src/"
    # The GPU cases as the tests stage selects them, with the wheel environment's python,
    # from the copies (so nothing of this tree is on the path).
    # shellcheck disable=SC2206
    if [ -n "${PYTEST_K:-}" ]; then PT_ARGS=(-q -k "$PYTEST_K"); else PT_ARGS=(${PYTEST_ARGS:--q -k gpu}); fi
    PYTHONPATH='' run_stage wheel_tests "$OUTDIR/wheel_tests.log" "${TESTS_TIMEOUT:-540}" \
      bash -c 'cd "$1" && shift && exec "$@"' _ "$WHEEL_WORK/src" "$WHEEL_WORK/venv/bin/python" \
      "$ROOT/dev/sharded_pytest.py" --jobs "${TEST_JOBS:-4}" --log-dir "$ROOT/out/wheel_test_shards" \
      -- "${PT_ARGS[@]}" tests
    DETAIL[wheel_tests]=$(grep -E "[0-9]+ (passed|failed|errors?|skipped)|no tests ran" "$OUTDIR/wheel_tests.log" | tail -n 1 | sed 's/=//g; s/^ *//')
    rm -rf "$WHEEL_WORK"
  else
    skip_stage wheel_tests "the wheel stage failed"
  fi
fi

# ---- 4. compute-sanitizer memcheck -----------------------------------------
find_sanitizer() {
  command -v compute-sanitizer 2>/dev/null && return
  local c
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer \
           /opt/nvidia/compute-sanitizer/compute-sanitizer; do
    [ -x "$c" ] && { echo "$c"; return; }
  done
  "$PY" - <<'EOF' 2>/dev/null   # pip's nvidia-cuda-sanitizer-api / cuda-toolkit wheels
import glob, os, sys
for p in sys.path:
    for c in glob.glob(os.path.join(p, "nvidia", "**", "compute-sanitizer"), recursive=True):
        if os.path.isfile(c) and os.access(c, os.X_OK):
            print(c); raise SystemExit
EOF
}

if [ "${SKIP_SANITIZER:-0}" = 1 ]; then
  skip_stage sanitizer SKIP_SANITIZER=1
else
  SAN=$(find_sanitizer | head -n 1)
  if [ -z "$SAN" ]; then
    STAGES+=(sanitizer); RESULT[sanitizer]="FAILED (compute-sanitizer not found)"
    echo; echo "=== [sanitizer] compute-sanitizer not found" | tee "$OUTDIR/sanitizer.log"
  else
    # Platform allocator: every XLA buffer is its own cudaMalloc, so memcheck catches an
    # access past a buffer's end; no preallocation; no CUDA graphs (plain launches); no
    # autotuning (XLA's GEMM autotuner would run many kernels under the sanitizer).
    SAN_TOOL=${SANITIZER_TOOL:-memcheck}
    run_sanitizer() {
      # shellcheck disable=SC2086
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \
      run_stage sanitizer "$OUTDIR/sanitizer.log" "${SANITIZER_TIMEOUT:-240}" \
        "$SAN" --tool "$SAN_TOOL" --target-processes all --error-exitcode 3 --print-limit 100 \
        ${SANITIZER_ARGS:---report-api-errors no} "$PY" dev/sanitizer_case.py ${SANITIZER_CASE_ARGS:-}
    }
    run_sanitizer
    san_rc=$?
    retried=""
    # memcheck / synccheck / initcheck end with "ERROR SUMMARY: N errors", racecheck with
    # "RACECHECK SUMMARY: N hazards displayed".
    summary_re="(ERROR|RACECHECK) SUMMARY"
    # compute-sanitizer itself sometimes dies of a segfault (exit 139, no summary line, up
    # to several times in a row): run it again, up to SANITIZER_RUNS runs in all (default 5;
    # a crash comes within seconds), and say so, keeping each crashed run's log.
    runs=1
    while [ "$san_rc" -ge 128 ] && ! grep -qE "$summary_re" "$OUTDIR/sanitizer.log" &&
          [ "$runs" -lt "${SANITIZER_RUNS:-5}" ]; do
      mkdir -p "$ROOT/out"
      mv "$OUTDIR/sanitizer.log" "$ROOT/out/sanitizer_crashed_$runs.log"
      retried+="run $runs: compute-sanitizer crashed (exit $san_rc; log out/sanitizer_crashed_$runs.log); "
      runs=$((runs + 1))
      run_sanitizer
      san_rc=$?
    done
    n_err=$(grep -oE "$summary_re: [0-9]+" "$OUTDIR/sanitizer.log" | awk '{s += $3} END {print s + 0}')
    n_sum=$(grep -cE "$summary_re" "$OUTDIR/sanitizer.log")
    case_line=$(grep -E "^sanitizer case:" "$OUTDIR/sanitizer.log" | tail -n 1)
    DETAIL[sanitizer]="${retried}$SAN_TOOL errors: $n_err (over $n_sum summary lines); ${case_line:-case output missing}"
    if [ "$SAN_TOOL" = racecheck ]; then
      # The grouped kernel's 7th template argument is kRowBlocks: only a hazard in a
      # row-split kernel (kRowBlocks > 1) is a finding (see the header).
      n_split=$(grep -oE "GroupedAttentionKernel<[^>]*>" "$OUTDIR/sanitizer.log" |
                awk -F', ' '$7 != "(int)1"' | sort -u | wc -l)
      DETAIL[sanitizer]+="; row-split kernels with a hazard: $n_split"
    fi
    if [ "$n_err" -gt 0 ] && [ "${RESULT[sanitizer]}" = ok ]; then RESULT[sanitizer]="FAILED"; fi
    if [ "$n_sum" -eq 0 ] && [ "${RESULT[sanitizer]}" = ok ]; then RESULT[sanitizer]="FAILED (no summary line)"; fi
  fi
fi

# ---- 5. benchmark ----------------------------------------------------------
if [ "${SKIP_BENCH:-0}" = 1 ]; then
  skip_stage bench SKIP_BENCH=1
elif [ -n "${BENCH_ENVS:-}" ]; then
  # One run per environment (A/B of runtime switches, each with its own copy bandwidth):
  # bench_<i>.json in OUT, logs in out/bench_envs/ (the device tool returns few files).
  mkdir -p "$ROOT/out/bench_envs"
  i=0
  IFS=';' read -ra ENV_LIST <<< "$BENCH_ENVS"
  for assignments in "${ENV_LIST[@]}"; do
    i=$((i + 1))
    echo; echo "--- bench_$i environment: ${assignments:-(unchanged)}"
    # shellcheck disable=SC2086
    run_stage "bench_$i" "$ROOT/out/bench_envs/bench_$i.log" "${BENCH_TIMEOUT:-420}" \
      env $assignments "$PY" -u benchmarks/bench_paged_attention.py --no-progress \
      --json "$OUTDIR/bench_$i.json" --png "$ROOT/out/bench_envs/bench_$i.png" ${BENCH_ARGS:-}
    DETAIL[bench_$i]="$assignments"
  done
else
  # shellcheck disable=SC2086
  run_stage bench "$OUTDIR/bench.log" "${BENCH_TIMEOUT:-420}" "$PY" -u benchmarks/bench_paged_attention.py \
    --json "$OUTDIR/bench.json" --png "$OUTDIR/bench.png" ${BENCH_ARGS:-}
  DETAIL[bench]="json: $( [ -f "$OUTDIR/bench.json" ] && echo "$OUTDIR/bench.json" || echo missing ); png: $( [ -f "$OUTDIR/bench.png" ] && echo "$OUTDIR/bench.png" || echo missing ); log: $OUTDIR/bench.log"
fi

# ---- 5b. decode loop (DECODE_VARIANTS) --------------------------------------
if [ -n "${DECODE_VARIANTS:-}" ]; then
  DEFAULT_DECODE_ARGS="--model llama3-8b --layers 4 --dtype bfloat16 --max-batch 32 --num-requests 32 \
    --prompt-len 1000 2000 --max-new-tokens 128 128 --max-seq-len 2176 --num-blocks 4352 --skip-dense-check"
  i=0
  IFS=';' read -ra DECODE_LIST <<< "$DECODE_VARIANTS"
  for variant in "${DECODE_LIST[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    run_stage "decode_$i" "$OUTDIR/decode_$i.log" "${DECODE_TIMEOUT:-240}" "$PY" -u examples/generate.py \
      ${DECODE_ARGS:-$DEFAULT_DECODE_ARGS} $variant --show 0 --json "$OUTDIR/decode_$i.json"
    DETAIL[decode_$i]="$variant: $(grep -E "tokens/s" "$OUTDIR/decode_$i.log" | tail -n 1 | sed 's/^ *//')"
  done
fi

# ---- 6. summary ------------------------------------------------------------
FAILED=0  # any stage's final result a failure
for s in "${STAGES[@]}"; do case ${RESULT[$s]} in FAILED*) FAILED=1 ;; esac; done
{
  echo
  echo "================================ SUMMARY ================================"
  for s in "${STAGES[@]}"; do
    printf '%-10s %-34s %5ss  %s\n' "$s" "${RESULT[$s]}" "${SECONDS_TAKEN[$s]:-0}" "${DETAIL[$s]:-}"
  done
  if [ -f "$OUTDIR/bench.log" ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
    echo
    echo "benchmark summary (full table in bench.log):"
    awk '/kv MB +auto us/ {p = 1} p' "$OUTDIR/bench.log"
    grep -E "^!!! " "$OUTDIR/bench.log" | head -20
  fi
  echo
  echo "logs and results: $OUTDIR"
  if [ "$FAILED" -eq 0 ]; then echo "gpu_check: ALL STAGES OK"; else echo "gpu_check: SOME STAGES FAILED"; fi
} | tee -a "$SUMMARY"

# ---- 7. bundle (BUNDLE=1) ----------------------------------------------------
# The device tool brings back only a few files of OUT: everything but the summary into
# one archive.
if [ "${BUNDLE:-0}" = 1 ]; then
  (cd "$OUTDIR" && find . -maxdepth 1 -type f ! -name summary.txt ! -name bundle.tar.gz -printf '%f\n' \
    | LC_ALL=C sort > .bundle_list && tar -czf bundle.tar.gz -T .bundle_list \
    && xargs rm -f < .bundle_list; rm -f .bundle_list) \
    && echo "bundle: $OUTDIR/bundle.tar.gz (tar -xzf it; summary.txt beside it)"
fi
exit "$FAILED"
