#!/usr/bin/env bash
# Configures and builds the hostile-input tree (default build-sanitize/): clang++, the CPU library and every
# test suite with AddressSanitizer + UndefinedBehaviorSanitizer (a finding aborts), plus the libFuzzer
# harnesses of tests/fuzz. `make test` runs its ctest after the main build's; tools/fuzz.sh fuzzes with it.
# It is also CI's clang++ build (the main build uses g++).
#   tools/sanitize-build.sh [BUILD_DIR] [FUZZ_SECONDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build-sanitize}
seconds=${2:-30}
cd "$root"
cmake -S . -B "$build" $(tools/cmake-generator.sh "$build") -DKVLITE_CUDA=OFF -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" -DKVLITE_SANITIZE=ON -DKVLITE_BUILD_FUZZERS=ON \
  -DKVLITE_FUZZ_SECONDS="$seconds" > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
rm -f "$build.configure.log"
cmake --build "$build" -j "${JOBS:-$(nproc)}"
