#!/usr/bin/env bash
# The machine code (SASS) of kernels.cu's kernels for one target, from this machine's nvcc, no GPU needed: per
# kernel instantiation its instruction count and the opcodes that matter to the decode kernels (HMMA, LDG, LDS,
# STG, SHF, LOP3, HADD2 / HMUL2 / HFMA2, branches), and with --histogram every opcode. For kernels that are bound by
# instruction issue (the decode GEMVs: bench/RESULTS.md, 2026-11-27), a change's effect on what a tile costs shows
# here before any device time is spent; the device's cuobjdump and Nsight Compute say the same there.
#
#     tools/kernel-sass.sh [--arch 90] [--ptx 90] [--grep PATTERN] [--histogram] [--dump FILE] [-DKNOB=VALUE ...]
#
#   --ptx N          compile sm_<arch> from compute_N's PTX (default: its own), as the default build does for
#                    sm_86 and sm_87 (tools/check-shared-ptx.sh)
#
#   --grep PATTERN   kernels whose mangled name matches (grep -E), e.g. 'quant_gemv_mma_kernelILNS1_8QgFormatE0E13'
#                    (int4, bf16 activations); default every kernel
#   --dump FILE      the matching kernels' SASS into FILE
#   -D...            build knobs (KVLITE_GEMV_FP8_RING=0, KVLITE_GEMV_INT4_UNROLL=8, ...), as build-gpu-variant.sh
#   --from FILE      count a SASS listing already made (cuobjdump -sass; the device probe's gemv.sass) instead
#
# cuobjdump: $KVLITE_CUOBJDUMP, else PATH, else /usr/local/cuda/bin, else the one that Triton's wheel carries with its
# nvdisasm (`pip download triton --no-deps`, unpacked once into ~/.cache/kvlite-tools; a dev machine with a network). The
# CUDA image of this project's build machine has nvcc and ptxas but no cuobjdump.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
arch=90 ptx="" pattern=. histogram=0 dump="" from="" flags=()
while [ $# -gt 0 ]; do
  case $1 in
    --arch) arch=$2; shift 2 ;;
    --ptx) ptx=$2; shift 2 ;;
    --grep) pattern=$2; shift 2 ;;
    --histogram) histogram=1; shift ;;
    --dump) dump=$2; shift 2 ;;
    --from) from=$2; shift 2 ;;
    -D*) flags+=("$1"); shift ;;
    *) echo "usage: tools/kernel-sass.sh [--arch 90] [--ptx 90] [--grep PATTERN] [--histogram] [--dump FILE] [-DKNOB=VALUE ...]" >&2; exit 2 ;;
  esac
done

# cuobjdump -sass runs nvdisasm, which it looks for on PATH: the two come from the same place.
find_cuobjdump() {
  local candidate cache="$HOME/.cache/kvlite-tools"
  for candidate in "${KVLITE_CUOBJDUMP:-}" "$(command -v cuobjdump || true)" /usr/local/cuda/bin/cuobjdump; do
    [ -n "$candidate" ] && [ -x "$candidate" ] && { echo "$candidate"; return 0; }
  done
  [ -x "$cache/cuobjdump" ] && [ -x "$cache/nvdisasm" ] && { echo "$cache/cuobjdump"; return 0; }
  local wheels
  wheels=$(mktemp -d)
  if python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$wheels" triton >&2 2>/dev/null &&
     mkdir -p "$cache" &&
     unzip -o -j -q "$wheels"/triton-*.whl 'triton/backends/nvidia/bin/cuobjdump' \
       'triton/backends/nvidia/bin/nvdisasm' -d "$cache" >&2; then
    chmod +x "$cache/cuobjdump" "$cache/nvdisasm"
    rm -rf "$wheels"
    echo "$cache/cuobjdump"
    return 0
  fi
  rm -rf "$wheels"
  return 1
}
cubin=$(mktemp --suffix=.cubin)
sass=$(mktemp)
trap 'rm -f "$cubin" "$sass"' EXIT
if [ -n "$from" ]; then
  awk -v pattern="$pattern" '/Function : /{keep = ($0 ~ pattern)} keep' "$from" > "$sass"
else
  cuobjdump=$(find_cuobjdump) || { echo "kernel-sass: no cuobjdump (set KVLITE_CUOBJDUMP, or allow pip to fetch Triton's)" >&2; exit 1; }
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  # The flags of the CMake build's kernels.cu (Release), as tools/kernel-resources.sh uses them.
  "$nvcc" -DKVLITE_WITH_CUDA=1 -I"$root" -I/usr/include/stb -O3 -DNDEBUG --expt-relaxed-constexpr -std=c++17 \
    "${flags[@]}" --generate-code=arch=compute_${ptx:-$arch},code=sm_$arch -cubin "$root/kernels.cu" -o "$cubin"
  PATH="$(dirname "$cuobjdump"):$PATH" "$cuobjdump" -sass "$cubin" | awk -v pattern="$pattern" '/Function : /{keep = ($0 ~ pattern)} keep' > "$sass"
fi
[ -n "$dump" ] && cp "$sass" "$dump"

# One line per kernel: its instructions (the listing's /*address*/ lines, NOPs left out) and the opcodes that
# matter here; --histogram adds every opcode.
awk -v histogram="$histogram" '
  function flush() {
    if (name == "") return
    printf "%6d instr  HMMA %3d  LDG %3d  LDS %3d  STG %3d  SHF %3d  LOP3 %3d  H*2 %3d  BRA %3d  %s\n",
           total, count["HMMA"], count["LDG"], count["LDS"], count["STG"], count["SHF"], count["LOP3"],
           count["HADD2"] + count["HMUL2"] + count["HFMA2"], count["BRA"], name
    if (histogram) {
      for (op in count) printf "         %-10s %d\n", op, count[op] | "sort -k2 -n -r"
      close("sort -k2 -n -r")
    }
    delete count
    total = 0
  }
  /Function : / { flush(); name = $NF; next }
  /^[[:space:]]*\/\*[0-9a-f][0-9a-f][0-9a-f][0-9a-f]+\*\// {
    line = $0
    sub(/^[[:space:]]*\/\*[0-9a-f]+\*\/[[:space:]]*/, "", line)
    sub(/^@!?U?P[0-9T] /, "", line)           # a predicate guard
    split(line, word, /[ .;]/)
    op = word[1]
    if (op == "" || op == "NOP") next
    total++
    count[op]++
  }
  END { flush() }
' "$sass" | c++filt | sed -E 's/kvlite::cuda::\(anonymous namespace\):://g'
