#!/usr/bin/env bash
# The NEON kernels' suite: tests/unit-cpu-fast.cpp and tests/unit-cpu-lowp.cpp cross-compiled for AArch64 (with
# the library, linked statically) and run under qemu-user on two emulated CPUs:
#   -cpu max          NEON and the dot-product extension: the fast kernels on neon, fast-lowp's integer kernels on sdot
#   -cpu cortex-a72   NEON without dotprod (a Raspberry Pi 4, Jetson Nano's A57 alike): fast-lowp falls back to
#                     its portable integer kernels
# Each suite forces every ISA the CPU reports (portable and neon), so both are checked against the reference
# exactly as on x86; KVLITE_EXPECT_LOWP_KERNELS makes cpu-lowp check which integer kernels the backend picked.
# Registered by tests/CMakeLists.txt where aarch64-linux-gnu-g++, qemu-aarch64 and the arm64 libpcre2-8 /
# libturbojpeg archives are present (tools/install-deps.sh installs them).
#   tests/neon_qemu.sh OUT_DIR
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: tests/neon_qemu.sh OUT_DIR}
cxx=${KVLITE_AARCH64_CXX:-aarch64-linux-gnu-g++}
qemu=${KVLITE_QEMU_AARCH64:-qemu-aarch64}
mkdir -p "$out"
flags=(-std=c++17 -Wall -Wextra -Werror)

# Rebuild an object when its source, the header or a test helper header is newer (ctest reruns it after edits).
build() {  # object source opt extra...
  local object=$1 source=$2 opt=$3 header stale=0
  shift 3
  for header in "$source" "$root/kvlite.hpp" "$root"/tests/*.hpp; do
    [ "$header" -nt "$object" ] && stale=1
  done
  if [ ! -f "$object" ] || [ $stale = 1 ]; then
    "$cxx" "${flags[@]}" "$opt" "$@" -c "$source" -o "$object.part" && mv "$object.part" "$object"
  fi
}
tests_defs=(-I"$root" -I"$root/tests" -DKVLITE_SOURCE_DIR="\"$root\"" -DKVLITE_BINARY_DIR="\"$out\"")
build "$out/library.o" "$root/src/library.cpp" -O2 &
lib=$!
build "$out/main.o" "$root/tests/main.cpp" -O1
build "$out/cpu-fast.o" "$root/tests/unit-cpu-fast.cpp" -O1 "${tests_defs[@]}"
build "$out/cpu-lowp.o" "$root/tests/unit-cpu-lowp.cpp" -O1 "${tests_defs[@]}"
wait $lib
"$cxx" -static -o "$out/neon-tests" "$out/main.o" "$out/cpu-fast.o" "$out/cpu-lowp.o" "$out/library.o" \
  -lpcre2-8 -lturbojpeg -lpthread

cd "$root"
echo "== qemu-aarch64 -cpu max (NEON + dotprod)"
KVLITE_EXPECT_LOWP_KERNELS="fast-lowp neon dotprod kernels" "$qemu" -cpu max "$out/neon-tests"
echo "== qemu-aarch64 -cpu cortex-a72 (NEON, no dotprod)"
KVLITE_EXPECT_LOWP_KERNELS="fast-lowp neon kernels" "$qemu" -cpu cortex-a72 "$out/neon-tests"
