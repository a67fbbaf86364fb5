#!/usr/bin/env bash
# make demo: the main job on the bundled models.
#   1. each image under examples/images/ captioned by the captioner in every format shipped (BF16, FP8, W4A16),
#      next to the caption it must give (examples/images/captions.txt), on --backend auto; first the memory plan
#      of the engine that runs (caption_image --plan: the plan it opened with), then for each format the backend
#      that ran and its timings (open, time to first token, tokens/s);
#   2. the memory plans of the other configs under models/ on a planned 8 GiB CUDA card.
# KVLITE_DEMO_BACKEND=cuda (or cpu) runs the captions on that backend instead of auto (the device calls use it).
# Exit status 0 when every caption is right; 1 when one is wrong or a format fails to run (a quantized format
# that this build reports as unsupported is listed as skipped, not failed); 2 when something is missing.
set -euo pipefail
build=${1:-build}
root=$(cd "$(dirname "$0")/.." && pwd)
case "$build" in /*) ;; *) build="$root/$build" ;; esac  # an absolute build directory is taken as it is
kvlite="$build/kvlite"
caption_image="$build/caption_image"
captioner="$root/models/kvlite-captioner"
examples="$root/examples/images"
for tool in "$kvlite" "$caption_image"; do
  [ -x "$tool" ] || { echo "demo: $tool is missing: run 'make build' first" >&2; exit 2; }
done
[ -f "$examples/captions.txt" ] || { echo "demo: $examples/captions.txt is missing" >&2; exit 2; }
echo "$("$kvlite" --version)"

plan() {  # plan DIR: exit 1 means "does not fit": the table and its advice are the demo, so only 2 stops it
  echo
  echo "== kvlite plan models/$(basename "$1") --backend cuda --device-mem 8GiB"
  local status=0
  "$kvlite" plan "$1" --backend cuda --device-mem 8GiB || status=$?
  [ "$status" -le 1 ] || exit "$status"
}

wrong=0
for format in bf16 fp8 w4a16; do
  dir="$captioner-$format"
  [ -d "$dir" ] || { echo; echo "demo: $dir is missing" >&2; exit 2; }
  echo
  echo "== build/caption_image models/$(basename "$dir") IMAGE"
  skipped=""
  right=0 total=0
  timings=""
  while IFS=$'\t' read -r image expected; do
    [ -n "$image" ] || continue
    status=0
    # The first caption of the demo also prints the plan its engine opened with.
    plan_flag=()
    if [ "$format" = bf16 ] && [ "$total" -eq 0 ]; then plan_flag=(--plan); fi
    caption=$("$caption_image" "$dir" "$examples/$image" --backend "${KVLITE_DEMO_BACKEND:-auto}" "${plan_flag[@]}" \
      2>"$build/demo.stderr") || status=$?
    if [ "${#plan_flag[@]}" -gt 0 ] && [ "$status" -eq 0 ]; then
      echo "  the plan of the engine that runs (caption_image --plan):"
      grep -v '^caption_image: ' "$build/demo.stderr" | sed 's/^/    /'
    fi
    if [ "$status" -ne 0 ]; then
      message=$(tail -n 1 "$build/demo.stderr")
      if [ "$format" != bf16 ] && [[ "$message" == *"(unsupported)"* ]]; then
        skipped=$message
        break
      fi
      echo "  $image  FAILED (exit $status): $message"
      wrong=$((wrong + 1))
      total=$((total + 1))
      continue
    fi
    total=$((total + 1))
    [ -n "$timings" ] || timings=$(grep '^caption_image: backend' "$build/demo.stderr" | sed 's/^caption_image: //')
    if [ "$caption" = "$expected" ]; then
      right=$((right + 1))
      printf '  %s  ok     %s\n' "$image" "$caption"
    else
      wrong=$((wrong + 1))
      printf '  %s  WRONG  %s\n  %*s  expected %s\n' "$image" "$caption" "${#image}" "" "$expected"
    fi
  done < "$examples/captions.txt"
  if [ -n "$skipped" ]; then
    echo "  skipped: this build of kvlite cannot run the $format checkpoint yet:"
    echo "    $skipped"
  else
    echo "  $right of $total captions right"
    [ -z "$timings" ] || echo "  $timings (first image)"
  fi
done
rm -f "$build/demo.stderr"

shopt -s nullglob
for config in "$root"/models/*/config.json; do
  dir=$(dirname "$config")
  case "$dir" in "$captioner"-*) continue ;; esac  # captioned above, on the engine that runs
  plan "$dir"
done

if [ "$wrong" -ne 0 ]; then
  echo
  echo "demo: $wrong caption(s) wrong or failed" >&2
  exit 1
fi
