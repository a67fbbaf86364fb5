#!/usr/bin/env bash
# make demo: the main job on the bundled models. For now: the memory plan of each config shipped under models/
# on a planned 8 GiB card (kvlite's defaults otherwise), as `kvlite plan` prints it. Planning reads config.json
# and any safetensors headers only, so this runs anywhere, GPU or not.
set -euo pipefail
build=${1:-build}
root=$(cd "$(dirname "$0")/.." && pwd)
kvlite="$root/$build/kvlite"
[ -x "$kvlite" ] || { echo "demo: $kvlite is missing: run 'make build' first" >&2; exit 2; }
echo "$("$kvlite" --version)"
shopt -s nullglob
configs=("$root"/models/*/config.json)
if [ ${#configs[@]} -eq 0 ]; then
  echo "demo: no model configs under models/ (each model is a directory holding config.json)" >&2
  exit 2
fi
for config in "${configs[@]}"; do
  dir=$(dirname "$config")
  echo
  echo "== kvlite plan models/$(basename "$dir") --device-mem 8GiB"
  # Exit 1 means "does not fit": the table and its advice are the demo, so only exit 2 (an error) stops it.
  status=0
  "$kvlite" plan "$dir" --device-mem 8GiB || status=$?
  [ "$status" -le 1 ] || exit "$status"
done
