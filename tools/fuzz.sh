#!/usr/bin/env bash
# Runs every libFuzzer harness of tests/fuzz for SECONDS each (default 600), one after another, each from its
# committed corpus (read-only) into build-sanitize/fuzz/work/<harness>, and prints a table of executions,
# coverage (libFuzzer's cov: edges and ft: features) and findings. A finding leaves its input in
# build-sanitize/fuzz/artifacts/ and makes the script exit 1: add the input to tests/fuzz/crashes/<harness>/
# with the fix, so that every later `make test` replays it.
#   [FUZZ_JOBS=N] tools/fuzz.sh [SECONDS] [HARNESS...]   (make fuzz FUZZ_SECONDS=600 FUZZ_JOBS=2)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
seconds=${1:-600}
shift || true
build=build-sanitize
tools/sanitize-build.sh "$build" >/dev/null || { echo "fuzz: the sanitizer build failed"; exit 1; }
harnesses=("$@")
[ ${#harnesses[@]} -eq 0 ] && harnesses=($(ls tests/fuzz/fuzz_*.cpp | sed 's|.*/fuzz_||; s|\.cpp||'))
# FUZZ_JOBS harnesses at a time (default 1: each gets a whole core's worth of its SECONDS).
jobs=${FUZZ_JOBS:-1}
run_harness() {
  local name=$1 seconds=$2 build=$3
  mkdir -p "$build/fuzz/work/$name" "$build/fuzz/artifacts"
  local log="$build/fuzz/$name.log"
  "$build/fuzz/fuzz_$name" -rss_limit_mb=2560 -timeout=20 -max_len=262144 -max_total_time="$seconds" \
    -print_final_stats=1 -artifact_prefix="$build/fuzz/artifacts/$name-" "$build/fuzz/work/$name" \
    "tests/fuzz/corpus/$name" > "$log" 2>&1
  local rc=$?
  local execs last cov ft corp finding=none
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  cov=$(echo "$last" | grep -o 'cov: [0-9]*' | grep -o '[0-9]*')
  ft=$(echo "$last" | grep -o 'ft: [0-9]*' | grep -o '[0-9]*')
  corp=$(echo "$last" | grep -o 'corp: [0-9]*/[0-9A-Za-z]*' | sed 's/corp: //')
  [ $rc != 0 ] && finding="exit $rc: $(grep -m1 -E 'ERROR|runtime error|deadly|Timeout|out-of-memory' "$log" | cut -c1-120)"
  printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$name" "$seconds" "${execs:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" \
    "$finding" | tee "$build/fuzz/$name.row"
}
export -f run_harness
rm -f "$build"/fuzz/*.row
printf '%s\n' "${harnesses[@]}" | xargs -P "$jobs" -I{} bash -c 'run_harness "$@"' _ {} "$seconds" "$build"
status=0
printf '| harness | seconds | executions | cov | ft | corpus | findings |\n|---|---|---|---|---|---|---|\n' > "$build/fuzz/summary.md"
for name in "${harnesses[@]}"; do
  cat "$build/fuzz/$name.row" >> "$build/fuzz/summary.md" 2>/dev/null || echo "| $name | | | | | | no result |" >> "$build/fuzz/summary.md"
  grep -q '| none |$' "$build/fuzz/$name.row" 2>/dev/null || status=1
done
echo "fuzz: table in $build/fuzz/summary.md, logs in $build/fuzz/<harness>.log"
exit $status
