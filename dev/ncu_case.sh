#!/usr/bin/env bash
# Nsight Compute profiles of the grouped kernel, one device call, from the repository root:
#
#     bash dev/ncu_case.sh
#
# Installs the default build (gpu_check.sh's install stage; skip with SKIP_INSTALL=1), then
# for each configuration of CONFIGS runs dev/profile_case.py under ncu (clocks left alone) with the sections that say where a kernel's
# cycles go: speed of light, pipes, warp states, instruction mix, memory, occupancy,
# and the per-instruction stall samples (SourceCounters). Each configuration leaves,
# flat in OUT:
#   <name>.ncu-rep      the report (opens in the Nsight Compute GUI), with KEEP_REP=1 only:
#                       with the stall samples it can pass the device tool's 16 MiB a file
#   details_<name>.txt  every section as text (ncu --page details)
#   source_<name>.csv   per SASS instruction: executed counts and stall samples
#                       (ncu --page source --csv; summarised by dev/ncu_summary.py)
#
# Environment:
#   OUT            where the files go (the device tool sets it; default ./out/ncu)
#   CONFIGS        ';'-separated "name=profile_case arguments" entries, default: bf16 and
#                  fp8 e4m3 caches at q_len 16, group 4, head 128, 512 and 4096 tokens
#                  (the row split's shortest and longest benchmark rows)
#   KERNEL_REGEX   kernels to profile (default GroupedAttentionKernel)
#   SKIP_INSTALL=1 profile the installed build
#   KEEP_REP=1     keep the .ncu-rep reports in OUT (else they go to a temporary folder)
#
# ncu replays each kernel once per pass (about 22 here) and saves and restores the device
# memory the kernel can reach around each replay ("Backing up device memory in system
# memory"); with JAX's default preallocation (75% of the GPU) that is ~100 GB a pass, too
# slow for a device call. So JAX allocates as it goes here (XLA_PYTHON_CLIENT_PREALLOCATE=false),
# and each case calls each kernel once (--calls 1).
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PY=${PYTHON:-python3}
OUTDIR=${OUT:-$PWD/out/ncu}
mkdir -p "$OUTDIR"
REPDIR=$OUTDIR
if [ -z "${KEEP_REP:-}" ]; then
  REPDIR=$(mktemp -d)
  trap 'rm -rf "$REPDIR"' EXIT
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
DEFAULT_CONFIGS="q16_512=--config 512,32,8,512 --impls grouped --kv bf16,fp8e4m3 --q-len 16 --calls 1;\
q16_4096=--config 64,32,8,4096 --impls grouped --kv bf16,fp8e4m3 --q-len 16 --calls 1"
CONFIGS=${CONFIGS:-$DEFAULT_CONFIGS}
REGEX=${KERNEL_REGEX:-GroupedAttentionKernel}
SECTIONS=(SpeedOfLight ComputeWorkloadAnalysis WarpStateStats InstructionStats SourceCounters
          Occupancy LaunchStats MemoryWorkloadAnalysis)
section_args=()
for s in "${SECTIONS[@]}"; do section_args+=(--section "$s"); done

if [ -z "${SKIP_INSTALL:-}" ]; then
  # gpu_check.sh's install stage alone: the default build (-DJAX_PAGED_DEV=OFF), which a
  # warm machine's build directory would otherwise keep from an earlier build (its logs go
  # to a temporary folder: OUT returns few files; it prints a failed build's errors).
  OUT=$(mktemp -d) SKIP_TESTS=1 SKIP_SANITIZER=1 SKIP_BENCH=1 bash dev/gpu_check.sh || exit 1
fi

FAILED=0
IFS=';' read -r -a entries <<< "$CONFIGS"
for entry in "${entries[@]}"; do
  name=${entry%%=*}
  args=${entry#*=}
  echo "=== $name: ncu ... dev/profile_case.py $args"
  # shellcheck disable=SC2086  # args: one string of profile_case arguments
  if ! ncu --clock-control none --kernel-name "regex:$REGEX" "${section_args[@]}" \
      -o "$REPDIR/$name" -f "$PY" dev/profile_case.py $args > "$OUTDIR/ncu_$name.log" 2>&1; then
    tail -n 30 "$OUTDIR/ncu_$name.log"
    FAILED=1
    continue
  fi
  rm -f "$OUTDIR/ncu_$name.log"
  ncu --import "$REPDIR/$name.ncu-rep" --page details > "$OUTDIR/details_$name.txt" 2>&1 || FAILED=1
  ncu --import "$REPDIR/$name.ncu-rep" --page source --csv --print-source sass \
    > "$OUTDIR/source_$name.csv" 2>&1 || FAILED=1
  grep -E "GroupedAttentionKernel|^ +Duration|Issue Slots Busy|Compute \(SM\) Throughput|Memory Throughput" \
    "$OUTDIR/details_$name.txt" | head -n 40
done
ls -la "$OUTDIR"
exit $FAILED
