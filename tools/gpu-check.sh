#!/usr/bin/env bash
# The whole GPU check in one command, for a machine with an NVIDIA GPU:
#   builds for the GPU's own arch, runs every test (the GPU ones run instead of skipping), runs the
#   benchmarks, and writes a results file.
#     tools/gpu-check.sh [OUT_DIR]     (default: $OUT when set, else build-gpu/results)
# Results: OUT_DIR/gpu-check.md (GPU, driver, commit, date, test summary, benchmark tables) + full logs.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:-${OUT:-build-gpu/results}}
mkdir -p "$out"
build=build-gpu
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
if [ -z "$arch" ]; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi gave no compute capability); nothing to check here." | tee "$out/gpu-check.md"
  exit 2
fi
[ "$arch" = 90 ] && arch=90a   # Hopper-only instructions (wgmma, TMA) need the arch-specific target
report="$out/gpu-check.md"
{
  echo "# kvlite GPU check"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "- gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
  echo "- arch: sm_$arch"
} > "$report"
tools/install-deps.sh
cmake -S . -B "$build" -DKVLITE_CUDA=ON -DKVLITE_CUDA_ARCHS="$arch" -DCMAKE_BUILD_TYPE=Release > "$out/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" >> "$out/build.log" 2>&1
build_status=$?
echo "- build: $([ $build_status = 0 ] && echo ok || echo FAILED, see build.log)" >> "$report"
[ $build_status = 0 ] || { tail -40 "$out/build.log"; exit 1; }
(cd "$build" && KVLITE_REQUIRE_GPU=1 ctest --output-on-failure -j 4) > "$out/tests.log" 2>&1
test_status=$?
{ echo; echo "## Tests"; echo '```'; grep -E 'tests passed|tests failed|Failed|\*\*\*' "$out/tests.log" | tail -30; echo '```'; } >> "$report"
# Benchmarks: every build/bench-* program prints its own table (validate first, then time).
for bench in "$build"/bench-*; do
  [ -x "$bench" ] || continue
  { echo; echo "## $(basename "$bench")"; echo '```'; "$bench" 2>&1; echo '```'; } >> "$report"
done
cat "$report"
exit $test_status
