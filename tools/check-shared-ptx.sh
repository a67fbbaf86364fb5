#!/usr/bin/env bash
# Shows that CMakeLists.txt's KVLITE_CUDA_GENCODE_ALL loses nothing: for each target whose machine code the default
# build makes from another target's PTX (sm_86 and sm_87 from compute_80), kernels.cu is compiled both ways
# (tools/kernel-sass.sh --ptx) and the SASS listings compared instruction for instruction (the header lines naming
# the PTX they came from left out). Any difference -- a new __CUDA_ARCH__ test between the shared targets, say --
# fails it. (120:90 differs, which is why sm_120 keeps its own PTX.) No GPU needed; ~2 CPU-minutes a compile.
#
#     tools/check-shared-ptx.sh [TARGET:PTX ...]      default: 86:80 87:80
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(86:80 87:80)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# sm_<target>'s listing from compute_<ptx>, without the header lines
listing() {  # target ptx
  "$root/tools/kernel-sass.sh" --arch "$1" --ptx "$2" --dump "$work/raw-$1-$2.sass" > /dev/null
  grep -v 'headerflags' "$work/raw-$1-$2.sass" > "$work/sm$1-from$2.sass"
}

status=0
for pair in "${pairs[@]}"; do
  target=${pair%%:*} ptx=${pair##*:}
  listing "$target" "$target" & own_pid=$!
  listing "$target" "$ptx" & shared_pid=$!
  wait $own_pid  # a failed compile stops the script (set -e)
  wait $shared_pid
  own="$work/sm$target-from$target.sass" shared="$work/sm$target-from$ptx.sass"
  lines=$(grep -c '/\*[0-9a-f]\{4,\}\*/' "$own" || true)
  if cmp -s "$own" "$shared"; then
    echo "sm_$target from compute_$ptx: the same machine code as from compute_$target ($lines instructions)"
  else
    echo "sm_$target from compute_$ptx: DIFFERS from compute_$target's ($(diff "$own" "$shared" | grep -c '^[<>]') lines):"
    diff "$own" "$shared" | head -20
    status=1
  fi
done
exit $status
