# Sourced by tools/device-call-1.sh and tools/device-call-2.sh: bounded steps whose results land under $OUT as
# they happen (a device call is killed at its limit; what is already under $OUT still comes back), and the
# binaries: gpu-bundle/ when it matches these sources and the GPU, else a build here (tools/gpu-check.sh's).
# At most 8 files come back from $OUT: the calls write call-N.md (the summary), build.log, gpu-check.md and
# one log per kind of step.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
dry_run=0
[ "${1:-}" = --dry-run ] && dry_run=1
out=${OUT:-$root/build-gpu/$call_name}
mkdir -p "$out"
summary="$out/$call_name.md"
call_started=$(date +%s)
budget=${KVLITE_CALL_BUDGET_S:-540}  # of the device call's 600 s: the rest is margin for the last step's kill
elapsed() { echo $(( $(date +%s) - call_started )); }
note() { echo "$*" >> "$summary"; echo "$*"; }
failed_steps=0

# run_step NAME SECONDS LOG COMMAND...: runs COMMAND with at most SECONDS (and never past the budget), its output
# appended to LOG under a header, one line in the summary: status, seconds, doctest's or the sanitizer's tally.
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$(( budget - $(elapsed) ))
  if [ "$left" -lt 15 ]; then
    note "- SKIPPED $name: past the ${budget} s budget"
    failed_steps=$((failed_steps + 1))
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "==== $name ($(date -u +%H:%M:%S), limit ${limit} s): $*" >> "$log"
  local step_started=$(date +%s) status tally
  local before=$(wc -l < "$log")
  timeout -k 10 "$limit" stdbuf -oL -eL "$@" >> "$log" 2>&1
  status=$?
  tally=$(tail -n +"$((before + 1))" "$log" | grep -E '^\[doctest\] (test cases|assertions)|ERROR SUMMARY|RACECHECK SUMMARY|tests passed, .* tests failed' |
          tr -s ' ' | tr '\n' ';')
  local verdict=ok
  [ $status = 124 ] || [ $status = 137 ] && verdict="TIMED OUT after ${limit} s"
  [ $status != 0 ] && [ "$verdict" = ok ] && verdict="FAILED (exit $status)"
  [ $status != 0 ] && failed_steps=$((failed_steps + 1))
  note "- $name: $verdict, $(( $(date +%s) - step_started )) s; $tally"
  return $status
}

machine_summary() {
  {
    echo "# kvlite $call_name"
    echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)$([ $dry_run = 1 ] && echo ' (DRY RUN: no GPU required, no sanitizers)')"
    echo "- sources: stamp $(tools/source-stamp.sh); gpu-bundle/: $(tr '\n' ' ' < gpu-bundle/MANIFEST 2>/dev/null || echo none)"
    echo "- gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -1)"
    echo "- nvcc $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*'); $(compute-sanitizer --version 2>/dev/null | grep -o 'Version.*' | head -1); $(ldd --version | head -1); $(uname -r)"
  } >> "$summary"
  cat "$summary"
}

# Sets $build: gpu-bundle/ through /tmp/kvlite-bundle/build when it matches, else builds TARGETS into build-gpu/.
choose_binaries() {  # choose_binaries TARGETS...
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  if [ -z "$arch" ]; then
    if [ $dry_run = 1 ]; then arch=90; else note "- NO GPU: nvidia-smi gives no compute capability"; exit 2; fi
  fi
  local extra
  if extra=$(tools/use-gpu-bundle.sh "$arch" 2>> "$out/build.log"); then
    build=/tmp/kvlite-bundle/build
    [ -n "$extra" ] && export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    note "- binaries: prebuilt gpu-bundle/ for sm_$arch${extra:+ (CUDA libraries from $extra)}"
  else
    note "- binaries: gpu-bundle/ not usable ($(tail -1 "$out/build.log")); building sm_$arch here"
    run_step "build (tools/gpu-check.sh's, targets: $*)" 420 "$out/build.log" \
      env KVLITE_GPU_CHECK_ARCH="$arch" KVLITE_GPU_CHECK_BUILD_ONLY=1 KVLITE_GPU_CHECK_BUNDLE=0 \
      KVLITE_GPU_CHECK_TARGETS="$*" tools/gpu-check.sh "$out" || { note "- build failed: see build.log"; exit 1; }
    build=$root/build-gpu
  fi
}
