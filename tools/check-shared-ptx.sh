#!/usr/bin/env bash
# Shows that CMakeLists.txt's KVLITE_CUDA_GENCODE_ALL loses nothing: for each target whose machine code the default
# build makes from another target's PTX (sm_86 and sm_87 from compute_80), kernels.cu is
# compiled both ways and the SASS listings compared instruction for instruction (the header line naming the PTX
# they came from left out). Any difference -- a new __CUDA_ARCH__ test between the shared targets, say -- fails it.
# (120:90 differs, which is why sm_120 keeps its own PTX.)
# No GPU needed; ~2 CPU-minutes a compile.
#
#     tools/check-shared-ptx.sh [TARGET:PTX ...]      default: 86:80 87:80
#
# cuobjdump as tools/kernel-sass.sh finds it ($KVLITE_CUOBJDUMP, PATH, /usr/local/cuda/bin, ~/.cache/kvlite-tools).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(86:80 87:80)
cuobjdump=""
for candidate in "${KVLITE_CUOBJDUMP:-}" "$(command -v cuobjdump || true)" /usr/local/cuda/bin/cuobjdump \
                 "$HOME/.cache/kvlite-tools/cuobjdump"; do
  [ -n "$candidate" ] && [ -x "$candidate" ] && { cuobjdump=$candidate; break; }
done
[ -n "$cuobjdump" ] || { echo "check-shared-ptx: no cuobjdump (run tools/kernel-sass.sh once, or set KVLITE_CUOBJDUMP)" >&2; exit 1; }
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# kernels.cu as the CMake build compiles it (Release, -lineinfo), for one target from one PTX
compile() {  # target ptx
  "$nvcc" -DKVLITE_WITH_CUDA=1 -I"$root" -I/usr/include/stb -O3 -DNDEBUG --expt-relaxed-constexpr -std=c++17 \
    -lineinfo --generate-code=arch=compute_$2,code=sm_$1 -cubin "$root/kernels.cu" -o "$work/sm$1-from$2.cubin"
  PATH="$(dirname "$cuobjdump"):$PATH" "$cuobjdump" -sass "$work/sm$1-from$2.cubin" | grep -v 'headerflags' \
    > "$work/sm$1-from$2.sass"
}

status=0
for pair in "${pairs[@]}"; do
  target=${pair%%:*} ptx=${pair##*:}
  compile "$target" "$target" & compile "$target" "$ptx" & wait
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
