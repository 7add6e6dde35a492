#!/usr/bin/env bash
# The kernels' machine code without a GPU: compiles one CUDA translation unit to a
# cubin for the H200 (sm_90, or sm_90a for the wgmma units) and writes
#   OUTDIR/<unit>.resources.txt   ptxas's per-kernel registers, stack frame and spills
#   OUTDIR/<unit>.sass            the disassembly (cuobjdump -sass)
# and prints the kernels that spill. No FFI headers are needed (the units under
# csrc/cuda/instances/ that hold the kernels' instantiations compile on their own).
#
#     bash dev/sass.sh csrc/cuda/instances/wgmma_grouped_bf16.cu [OUTDIR]
#
# cuobjdump and nvdisasm come from PATH or, where nvcc's toolkit has none, from
# NVIDIA's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels, fetched once into
# CUDA_TOOLS_DIR (default ~/.cache/jax_paged/cuda-tools) by pip. The grouped units take 1-5
# minutes (fp8 the longest); DEFINES="-DJAX_PAGED_TRACE" etc. pass development build options.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
unit=${1:?usage: dev/sass.sh csrc/cuda/instances/<unit>.cu [OUTDIR]}
out=${2:-out/sass}
[ -f "$unit" ] || { echo "sass.sh: no such file: $unit" >&2; exit 2; }
mkdir -p "$out"
name=$(basename "$unit" .cu)
case $name in
  wgmma_*) arch=(-gencode=arch=compute_90a,code=sm_90a) ;;
  *) arch=(-arch=sm_90) ;;
esac

# cuobjdump runs nvdisasm: both from PATH, else both from NVIDIA's wheels.
cuobjdump=$(command -v cuobjdump || true)
if [ -z "$cuobjdump" ] || ! command -v nvdisasm > /dev/null; then
  tools=${CUDA_TOOLS_DIR:-$HOME/.cache/jax_paged/cuda-tools}
  for tool in cuobjdump nvdisasm; do
    if [ -z "$(find "$tools" -type f -name "$tool" 2>/dev/null | head -n 1 || true)" ]; then
      echo "sass.sh: fetching $tool (pip: nvidia-cuda-$tool) into $tools" >&2
      mkdir -p "$tools/wheels"
      python3 -m pip download -q --no-deps -d "$tools/wheels" "nvidia-cuda-$tool"
      python3 -m zipfile -e "$tools"/wheels/nvidia_cuda_"$tool"-*.whl "$tools"
    fi
  done
  cuobjdump=$(find "$tools" -type f -name cuobjdump | head -n 1)
  nvdisasm=$(find "$tools" -type f -name nvdisasm | head -n 1)
  chmod +x "$cuobjdump" "$nvdisasm"
  export PATH="$(dirname "$nvdisasm"):$PATH"
fi

# shellcheck disable=SC2086  # DEFINES is a list of flags
nvcc -std=c++17 "${arch[@]}" -O3 --expt-relaxed-constexpr -Icsrc ${DEFINES:-} -Xptxas -v \
  -cubin -o "$out/$name.cubin" "$unit" > "$out/$name.resources.txt" 2>&1
"$cuobjdump" -sass "$out/$name.cubin" > "$out/$name.sass"
kernels=$(grep -c "Compiling entry function" "$out/$name.resources.txt" || true)
echo "$unit: $kernels kernels -> $out/$name.sass, $out/$name.resources.txt"
# Each kernel's name line, then its "N bytes spill stores" line: name the spilling ones.
awk '/Compiling entry function/ { k = $0; sub(/.*function \047/, "", k); sub(/\047.*/, "", k) }
     /bytes spill stores/ && $5 + 0 > 0 { print "  spills: " $0 "\n    in " k; n++ }
     END { if (!n) print "  no kernel spills" }' "$out/$name.resources.txt"
