#!/usr/bin/env bash
# ptxas's resource report for every kernel of kernels.cu, per target, from this machine's nvcc (no GPU needed):
# registers, spill stores / loads, stack frame and static shared memory, one line per kernel instantiation,
# the names demangled and shortened. What a kernel spills or how many registers hold its occupancy down shows
# here before any device time is spent (the GEMV's 4-row build: 125-193 registers on sm_90, one block per SM).
#
#     tools/kernel-resources.sh [--grep PATTERN] [ARCH ...]    (ARCH: 80 86 87 89 90 120; default all six)
#
# Exit status 1 when a kernel spills (stores or loads past its registers) on any target asked for.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pattern=.
if [ "${1:-}" = --grep ]; then pattern=$2; shift 2; fi
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(80 86 87 89 90 120)
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
spilled=0
for arch in "${archs[@]}"; do
  report=$(mktemp)
  # The flags of the CMake build's kernels.cu (Release), for one real target.
  "$nvcc" -DKVLITE_WITH_CUDA=1 -I"$root" -I/usr/include/stb -O3 -DNDEBUG --expt-relaxed-constexpr -std=c++17 \
    --generate-code=arch=compute_$arch,code=sm_$arch -Xptxas -v -x cu -c "$root/kernels.cu" -o /dev/null 2> "$report"
  echo "## sm_$arch"
  printf '%-6s %-6s %-6s %-6s %-7s %s\n' regs spillS spillL stack smem kernel
  # ptxas prints, per kernel: "Function properties for NAME", "N bytes stack frame, N bytes spill stores, N bytes
  # spill loads", then "Used N registers, ... N bytes smem".
  awk '
    /Function properties for/ { name = $NF; stack = spill_s = spill_l = 0; next }
    /bytes stack frame/ { stack = $1; spill_s = $5; spill_l = $9; next }
    /Used [0-9]+ registers/ {
      regs = ""; smem = 0
      for (i = 1; i <= NF; i++) { if ($i == "registers,") regs = $(i - 1); if ($i ~ /^smem,?$/) smem = $(i - 2) }
      if (name != "") print regs, spill_s, spill_l, stack, smem, name
      name = ""
    }' "$report" |
    while read -r regs spill_s spill_l stack smem name; do
      pretty=$(echo "$name" | c++filt | sed -E 's/kvlite::cuda::\(anonymous namespace\):://g; s/kvlite::cuda:://g;
        s/\(kvlite::cuda::QuantGemmArgs\)|\(QuantGemmArgs\)//; s/__nv_bfloat16/bf16/g; s/__half/f16/g')
      printf '%-6s %-6s %-6s %-6s %-7s %s\n' "$regs" "$spill_s" "$spill_l" "$stack" "$smem" "$pretty"
    done | grep -E -- "$pattern" | sort -k6 || true
  if awk '/bytes spill stores/ && ($5 > 0 || $9 > 0) { found = 1 } END { exit !found }' "$report"; then
    echo "sm_$arch: SPILLS (see above)"
    spilled=1
  fi
  rm -f "$report"
done
exit $spilled
