#!/usr/bin/env bash
# The whole GPU check in one command (`make gpu-check`), for a machine with an NVIDIA GPU:
#   1. build for the GPU's own arch (build-gpu/); dependencies the machine lacks come from .deps/ (made by
#      tools/fetch-gpu-deps.sh where there is a network, unpacked into .deps/root, never into /)
#   2. every test suite with the GPU ones required (KVLITE_REQUIRE_GPU=1): ctest for all but cuda-engine, then
#      test-cuda-engine alone (it measures the device's memory: nothing else may use the GPU meanwhile), its
#      measurements (logit differences, graph memory, device memory against the plan) kept in the report
#   3. kvlite bench: a fixture model, then random-weight checkpoints of real shapes (tools/make_random_checkpoint.py,
#      written to a temporary directory one at a time and deleted after) planned as an 8 GiB card
#      (--device-mem 8GiB); one that does not fit such a card is said so and benched as a 24 GiB card
#   4. OUT_DIR/gpu-check.md: GPU, driver, commit, time of each phase, test summary, measurements, bench tables;
#      beside it build.log, tests.log, cuda-engine.log, bench.log (five files: what a device call brings back)
#
#     tools/gpu-check.sh [OUT_DIR]     (default: $OUT when set, else build-gpu/results)
#
# Expected time on one H200 machine (16 cores), estimated (not yet measured), against a 10-minute device call:
#   build 4-7 min (kernels.cu for one arch is one nvcc process, the long pole; the C++ builds beside it),
#   tests 1-2 min, fixture benches under 30 s, real-shape checkpoints 3-4 min (Llama-3.1-8B BF16 16 GB, Qwen3-4B
#   BF16 8 GB, Llama-3.1-8B W4A16 5.7 GB, Qwen3-VL-4B text FP8 4.4 GB: each written at disk speed, uploaded,
#   benched, deleted). Past KVLITE_GPU_CHECK_BUDGET_S seconds (default 540) the remaining checkpoints are skipped
#   and the report says so. The build is kept in build-gpu/ while the machine stays warm, so the surest way is
#   two calls: `KVLITE_GPU_CHECK_BIG=0 make gpu-check`, then `KVLITE_GPU_CHECK_TESTS=0 make gpu-check`.
#   KVLITE_GPU_CHECK_BIG=0     no real-shape checkpoints (build, tests and the fixture benches)
#   KVLITE_GPU_CHECK_QUANT=0   real-shape checkpoints in BF16 only (the W4A16 / FP8 ones need issue 6's kernels;
#                              until then they report unsupported, which the report records)
#   KVLITE_GPU_CHECK_MODELS="llama-3.1-8b:w4a16 qwen3-4b:none"   these checkpoints only, in this order
#   KVLITE_GPU_CHECK_TESTS=0   no test suites (a second call: build up to date, benchmarks only)
#   KVLITE_GPU_CHECK_NCU_STEP=1 (or "llama-3.1-8b ...")   each checkpoint's (or these presets') decode step split
#                              into its kernels by Nsight Compute (ncu-step-*.csv, tools/ncu-step-summary.py)
#   KVLITE_GPU_CHECK_PROGRAMMATIC=0   on sm_90+, no second bench of each checkpoint with --no-programmatic-launch
#                              (default: benched both ways, the kernels launched programmatically (kvlite's
#                              default there) and ordinarily; so is each KVLITE_BASELINE whose kvlite has either
#                              flag: --no-programmatic-launch, or --programmatic-launch of builds where it was off)
#   KVLITE_GPU_CHECK_NCU_KERNELS="paged_attention_kernel:40:1 quant_gemv_mma_kernel:40:4"   with NCU_STEP's
#                              checkpoints: each named kernel's full Nsight Compute report (--set full: throughput,
#                              occupancy, warp stalls) for COUNT of its launches after skipping SKIP of them (40:
#                              past a 32-layer prompt's), in ncu-kernels-*.txt
# Prebuilt binaries: when gpu-bundle/ (tools/build-gpu-bundle.sh, carried by the device call) was built from these
# sources for this GPU's arch, no build at all (tools/use-gpu-bundle.sh); otherwise the build below, with ninja
# when present. Switches for tools/simulate-device.sh and tools/device-call-*.sh:
#   KVLITE_GPU_CHECK_ARCH=90        the arch to build for when nvidia-smi is absent (a machine without a GPU)
#   KVLITE_GPU_CHECK_BUILD_ONLY=1   stop after the build;  KVLITE_GPU_CHECK_TARGETS="a b"  build only these
#   KVLITE_GPU_CHECK_BUNDLE=0       ignore gpu-bundle/;    KVLITE_NO_APT=1  never apt-get install (fail instead)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:-${OUT:-build-gpu/results}}
mkdir -p "$out"
report="$out/gpu-check.md"
build=build-gpu
started=$(date +%s)
budget=${KVLITE_GPU_CHECK_BUDGET_S:-540}
elapsed() { echo $(( $(date +%s) - started )); }
phase() { echo "- $1: $2 ($(elapsed) s since start)" >> "$report"; }

arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
arch=${arch:-${KVLITE_GPU_CHECK_ARCH:-}}
if [ -z "$arch" ]; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi gave no compute capability); nothing to check here." | tee "$report"
  exit 2
fi
{
  echo "# kvlite GPU check"
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "- gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "- arch: sm_$arch; nvcc $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo missing)"
} > "$report"

# ---- 1. dependencies and build ----------------------------------------------------------------------------------
bundle_libraries=""
if [ "${KVLITE_GPU_CHECK_BUNDLE:-1}" != 0 ] && bundle_libraries=$(tools/use-gpu-bundle.sh "$arch" 2>> "$out/build.log"); then
  build=/tmp/kvlite-bundle/build
  [ -n "$bundle_libraries" ] && export LD_LIBRARY_PATH="$bundle_libraries${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  phase "build" "none: prebuilt gpu-bundle/ ($(tr '\n' ' ' < gpu-bundle/MANIFEST))"
  build_status=0
else
cmake_args=(-DKVLITE_CUDA=ON -DKVLITE_CUDA_ARCHITECTURES="${arch}-real" -DCMAKE_BUILD_TYPE=Release)
command -v ninja >/dev/null && cmake_args+=(-G Ninja)
have_header() { [ -f "/usr/include/$1" ] || [ -f "/usr/local/include/$1" ]; }
if have_header doctest/doctest.h && have_header nlohmann/json.hpp && have_header stb/stb_image.h && have_header pcre2.h && have_header turbojpeg.h &&
   command -v pkg-config >/dev/null; then
  phase "dependencies" "from the system"
elif ls .deps/*.deb >/dev/null 2>&1; then
  deps="$root/.deps/root"
  for deb in .deps/*.deb; do dpkg -x "$deb" "$deps"; done
  export PKG_CONFIG_SYSROOT_DIR="$deps"
  export PKG_CONFIG_PATH="$deps/usr/lib/x86_64-linux-gnu/pkgconfig:$deps/usr/share/pkgconfig"
  export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PATH="$PATH:$deps/usr/bin"  # pkg-config (pkgconf) when the machine has none; the system's first
  cmake_args+=(-DCMAKE_PREFIX_PATH="$deps/usr")
  phase "dependencies" "unpacked from .deps/ into .deps/root ($(ls .deps/*.deb | wc -l) packages)"
elif [ "${KVLITE_NO_APT:-0}" = 1 ]; then
  phase "dependencies" "MISSING: no system headers and no .deps/ (KVLITE_NO_APT=1: apt not tried)"
  cat "$report"; exit 1
else
  tools/install-deps.sh > "$out/build.log" 2>&1 || {
    phase "dependencies" "MISSING: no doctest/nlohmann/stb/pcre2 headers, no .deps/ and apt failed (run tools/fetch-gpu-deps.sh where there is a network and send .deps along)"
    cat "$report"; exit 1; }
  phase "dependencies" "installed with apt"
fi
targets=()
[ -n "${KVLITE_GPU_CHECK_TARGETS:-}" ] && targets=(--target ${KVLITE_GPU_CHECK_TARGETS})
{ cmake -S . -B "$build" "${cmake_args[@]}" && nice cmake --build "$build" -j "$(nproc)" "${targets[@]}"; } >> "$out/build.log" 2>&1
build_status=$?
phase "build" "$([ $build_status = 0 ] && echo ok || echo 'FAILED, see build.log')"
if [ $build_status != 0 ]; then
  tail -60 "$out/build.log"
  cat "$report"
  exit 1
fi
fi
[ "${KVLITE_GPU_CHECK_BUILD_ONLY:-0}" = 1 ] && { cat "$report"; exit 0; }

# ---- 2. tests ---------------------------------------------------------------------------------------------------
export KVLITE_REQUIRE_GPU=1
ctest_status=0
engine_status=0
if [ "${KVLITE_GPU_CHECK_TESTS:-1}" != 0 ]; then
  excluded='^cuda-engine:'  # doctest_discover_tests drops the prefix's space: 'cuda-engine:<case>'
  [ "$build" = /tmp/kvlite-bundle/build ] && excluded='^(cuda-engine|cmake):'  # the bundle has no build tree to install
  (cd "$build" && ctest --output-on-failure -j 4 -E "$excluded") > "$out/tests.log" 2>&1
  ctest_status=$?
  phase "tests (all but cuda-engine)" "$([ $ctest_status = 0 ] && echo passed || echo 'FAILED, see tests.log')"
  "$build/tests/test-cuda-engine" > "$out/cuda-engine.log" 2>&1
  engine_status=$?
  phase "tests (cuda-engine, alone)" "$([ $engine_status = 0 ] && echo passed || echo 'FAILED, see cuda-engine.log')"
  {
    echo
    echo "## Tests"
    echo '```'
    grep -E 'tests passed|tests failed|\*\*\*Failed|Failed  ' "$out/tests.log" | tail -30
    grep -E '^\[doctest\] (test cases|assertions|Status)' "$out/cuda-engine.log"
    echo '```'
    echo
    echo "## Engine measurements (test-cuda-engine's messages)"
    echo '```'
    grep -E 'MESSAGE' "$out/cuda-engine.log" | head -80
    echo '```'
  } >> "$report"
else
  phase "tests" "skipped (KVLITE_GPU_CHECK_TESTS=0)"
fi

# ---- 3. benchmarks ----------------------------------------------------------------------------------------------
kvlite="$build/kvlite"
bench_args=(--batch 1,8 --prompt-tokens 128 --decode-tokens 64)
bench() {  # bench TITLE MODEL_DIR [extra kvlite options...]
  local title=$1 dir=$2
  shift 2
  echo "## bench: $title" >> "$report"
  echo '```' >> "$report"
  $kvlite bench "$dir" "${bench_args[@]}" "$@" > "$out/bench-one.txt" 2>&1
  local status=$?
  cat "$out/bench-one.txt" >> "$report"
  { echo "### $title (exit $status)"; cat "$out/bench-one.txt"; } >> "$out/bench.log"
  echo '```' >> "$report"
  return $status
}
bench "tiny-qwen3 fixture (CUDA)" tests/fixtures/models/tiny-qwen3 --backend cuda --device-mem 2GiB
gpu_bench_args=("${bench_args[@]}")
bench_args=(--batch 1,8 --prompt-tokens 128 --decode-tokens 16)  # (the CPU is slower: fewer tokens)
bench "tiny-qwen3 fixture (CPU, for comparison)" tests/fixtures/models/tiny-qwen3 --backend cpu --device-mem 1GiB
bench_args=("${gpu_bench_args[@]}")
phase "fixture bench" "done"

if [ "${KVLITE_GPU_CHECK_BIG:-1}" != 0 ]; then
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/kvlite-gpu-check.XXXXXX")
  models=("llama-3.1-8b none" "qwen3-4b none")
  [ "${KVLITE_GPU_CHECK_QUANT:-1}" != 0 ] && models+=("llama-3.1-8b w4a16" "qwen3-vl-4b-text fp8")
  if [ -n "${KVLITE_GPU_CHECK_MODELS:-}" ]; then  # "preset:quant preset:quant ...", in this order
    models=()
    for entry in $KVLITE_GPU_CHECK_MODELS; do models+=("${entry%%:*} ${entry##*:}"); done
  fi
  # Nsight Compute, for KVLITE_GPU_CHECK_NCU_STEP below
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for entry in "${models[@]}"; do
    read -r preset quant <<< "$entry"
    title="$preset $([ "$quant" = none ] && echo BF16 || echo "$quant") (random weights)"
    if [ "$(elapsed)" -gt "$budget" ]; then
      phase "$title" "SKIPPED: past the ${budget} s budget"
      continue
    fi
    dir="$scratch/$preset-$quant"
    python3 tools/make_random_checkpoint.py "$preset" "$dir" --quant "$quant" >> "$out/bench.log" 2>&1 || {
      phase "$title" "FAILED to write the checkpoint, see bench.log"; rm -rf "$dir"; continue; }
    phase "$title" "checkpoint written"
    bench "$title, planned as an 8 GiB card" "$dir" --backend cuda --device-mem 8GiB --profile
    status=$?
    if [ $status = 1 ]; then  # does not fit an 8 GiB card: the same on a 24 GiB one
      bench "$title, planned as a 24 GiB card (does not fit 8 GiB)" "$dir" --backend cuda --device-mem 24GiB --profile
      status=$?
    fi
    # the same checkpoint launched ordinarily (sm_90+, where programmatic dependent launch is the default:
    # CudaBackendOptions::programmatic_launch), planned the same way, so the two tables side by side show what it saves
    if [ "${KVLITE_GPU_CHECK_PROGRAMMATIC:-1}" != 0 ] && [ "$arch" -ge 90 ] && [ $status = 0 ]; then
      bench "$title, ordinary launch, planned as an 8 GiB card" "$dir" --backend cuda --device-mem 8GiB \
        --no-programmatic-launch
    fi
    # the same checkpoint through each baseline's kvlite (KVLITE_BASELINE: one folder or several, space-separated:
    # an earlier commit's build, or a variant library from tools/build-gpu-variant.sh), planned the same way
    for baseline in ${KVLITE_BASELINE:-}; do
      [ -x "$baseline/kvlite" ] && [ $status = 0 ] || continue
      saved_kvlite=$kvlite
      kvlite="env LD_LIBRARY_PATH=$baseline/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} $baseline/kvlite"
      bench "$title, BASELINE kvlite ($baseline), planned as an 8 GiB card" "$dir" --backend cuda --device-mem 8GiB
      # and launched the other way where that baseline's kvlite has a flag for it: ordinarily (builds where
      # programmatic launch is the default), or programmatically (earlier builds, where it was off by default)
      if [ "${KVLITE_GPU_CHECK_PROGRAMMATIC:-1}" != 0 ] && [ "$arch" -ge 90 ]; then
        baseline_help=$($kvlite bench --help 2>&1)
        if grep -q -- --no-programmatic-launch <<< "$baseline_help"; then
          bench "$title, BASELINE kvlite ($baseline), ordinary launch, planned as an 8 GiB card" "$dir" \
            --backend cuda --device-mem 8GiB --no-programmatic-launch
        elif grep -q -- --programmatic-launch <<< "$baseline_help"; then
          bench "$title, BASELINE kvlite ($baseline), programmatic launch, planned as an 8 GiB card" "$dir" \
            --backend cuda --device-mem 8GiB --programmatic-launch
        fi
      fi
      kvlite=$saved_kvlite
    done
    # KVLITE_GPU_CHECK_NCU_STEP=1: every kernel of a short run timed alone by Nsight Compute (gpu__time_duration,
    # the card's clocks as found, caches not flushed: a kernel finds in L2 what the one before it wrote, as in the
    # graph), graph nodes one by one, so a decode step splits into its kernels; the CSV goes to
    # ncu-step-PRESET-QUANT.csv (tools/ncu-step-summary.py reads it), the table into the report
    # (KVLITE_GPU_CHECK_NCU_STEP="llama-3.1-8b ...": those presets only)
    ncu_step=${KVLITE_GPU_CHECK_NCU_STEP:-0}
    [ "$ncu_step" != 0 ] && [ "$ncu_step" != 1 ] && { [[ " $ncu_step " == *" $preset "* ]] || ncu_step=0; }
    if [ "$ncu_step" != 0 ] && [ -n "$ncu" ] && [ $status = 0 ]; then
      csv="$out/ncu-step-$preset-$quant.csv"
      timeout 150 "$ncu" --clock-control none --cache-control none --csv --print-units base --metrics gpu__time_duration.sum \
        $kvlite bench "$dir" --backend cuda --device-mem 8GiB --batch 1 --prompt-tokens 128 --decode-tokens 3 \
        > "$csv" 2> "$out/ncu-step.err"
      phase "$title" "ncu step breakdown exit $? ($(grep -c gpu__time_duration "$csv") kernels timed)"
      { echo "### ncu: one decode step's kernels, $title"; echo '```'
        python3 tools/ncu-step-summary.py "$csv" 2>&1 | head -60; echo '```'; } >> "$report"
      # the named kernels in full, for where their time goes
      for entry in ${KVLITE_GPU_CHECK_NCU_KERNELS:-}; do
        IFS=: read -r kernel skip count <<< "$entry"
        details="$out/ncu-kernels-$preset-$quant.txt"
        echo "==== $kernel (skip ${skip:-40}, count ${count:-1})" >> "$details"
        timeout 120 "$ncu" --set full --import-source no --clock-control none --print-summary none \
          -k "regex:$kernel" --launch-skip "${skip:-40}" --launch-count "${count:-1}" \
          $kvlite bench "$dir" --backend cuda --device-mem 8GiB --batch 1 --prompt-tokens 128 --decode-tokens 3 \
          >> "$details" 2>> "$out/ncu-kernels.err"
        phase "$title" "ncu full report of $kernel exit $?"
      done
    fi
    phase "$title" "bench exit $status"
    rm -rf "$dir"
  done
  rm -rf "$scratch"
fi
rm -f "$out/bench-one.txt"
phase "total" "$(elapsed) s"
cat "$report"
[ $build_status = 0 ] && [ $ctest_status = 0 ] && [ $engine_status = 0 ]
