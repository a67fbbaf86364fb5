#!/usr/bin/env bash
# What travels to the device machine is limited to 64 MiB (/work/.library/device/README.md: tracked and
# untracked-not-ignored files plus `carry`). The repository alone has grown to ~62 MiB (fixtures of every family
# and format), so neither gpu-bundle/ (~15 MB) nor .deps/ (2.6 MB, the on-device build's -dev packages) fits beside
# it any more. The device calls (tools/device-calls.sh: the five GPU suites, kvlite, the benches) read only some of
# the fixtures; this script moves the ones only the CPU suites read into .device-offload/ (git-ignored through
# .git/info/exclude) before a call, and back after it:
#
#     tools/device-trim.sh off     # before `run`: move them out; prints what would travel against 64 MiB
#     tools/device-trim.sh on      # after the calls: put them back (git status is clean again)
#     tools/device-trim.sh size    # what would travel now, in bytes and MiB, with gpu-bundle/ and .deps/
#
# Moved (none of them is read by test-cuda-ops, test-cuda-quant, test-cuda-host, test-quant-gpu-host,
# test-cuda-engine, the demo or the benches; `grep -o 'fixtures/[a-z_0-9.-]*' tests/unit-cuda-*.cpp
# tests/unit-quant-gpu-host.cpp` lists what those read): the real tokenizer archives and tokenizer cases, the
# RoPE fixtures, the chat templates, the Unicode tables' cases, the fuzz corpus, the captioner's recorded logits
# and the archived benchmark outputs. With the tree trimmed, run only the GPU suites on the device (device-calls.sh
# does; a full `ctest` there, as tools/gpu-check.sh runs it, would fail the CPU suites whose fixtures stayed here).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
offload=.device-offload
moved=(tests/fixtures/tokenizers tests/fixtures/rope tests/fixtures/chat_templates tests/fixtures/unicode
       tests/fuzz/corpus tests/fixtures/captioner bench/results)
limit=$((64 * 1024 * 1024))

ensure_excluded() {
  grep -qx "/$offload/" .git/info/exclude 2>/dev/null || echo "/$offload/" >> "$(git rev-parse --git-path info/exclude)"
}

# Bytes that would travel: tracked files present in the working tree plus untracked files git does not ignore,
# then the same with gpu-bundle/ and .deps/ carried.
travelling_bytes() {
  { git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' file; do
      [ -f "$file" ] && printf '%s\0' "$file"
    done; } | xargs -0 -r du -cb | tail -1 | cut -f1
}

report() {
  local tree bundle=0 deps=0
  tree=$(travelling_bytes)
  [ -d gpu-bundle ] && bundle=$(du -sb gpu-bundle | cut -f1)
  [ -d .deps ] && deps=$(du -sb .deps | cut -f1)
  local mib=$((1024 * 1024))
  printf 'working tree that travels: %d bytes (%d.%02d MiB)\n' "$tree" $((tree / mib)) $((tree % mib * 100 / mib))
  printf '  + gpu-bundle/ %d bytes + .deps/ %d bytes = %d bytes (%d.%02d MiB) of the %d MiB a call carries\n' \
    "$bundle" "$deps" $((tree + bundle + deps)) $(((tree + bundle + deps) / mib)) \
    $(((tree + bundle + deps) % mib * 100 / mib)) $((limit / mib))
  if [ $((tree + bundle + deps)) -gt $limit ]; then
    echo "  OVER the limit by $((tree + bundle + deps - limit)) bytes: trim (off), carry less, or build on the device"
  fi
}

case "${1:-}" in
  off)
    ensure_excluded
    for path in "${moved[@]}"; do
      if [ -e "$path" ]; then
        mkdir -p "$offload/$(dirname "$path")"
        [ -e "$offload/$path" ] && { echo "device-trim: $offload/$path already exists; run '$0 on' first" >&2; exit 1; }
        mv "$path" "$offload/$path"
        echo "moved $path -> $offload/$path"
      fi
    done
    report
    ;;
  on)
    for path in "${moved[@]}"; do
      if [ -e "$offload/$path" ]; then
        [ -e "$path" ] && { echo "device-trim: both $path and $offload/$path exist; resolve by hand" >&2; exit 1; }
        mkdir -p "$(dirname "$path")"
        mv "$offload/$path" "$path"
        echo "restored $path"
      fi
    done
    find "$offload" -depth -type d -empty -delete 2>/dev/null || true
    git status --short | head -5
    report
    ;;
  size)
    report
    ;;
  *)
    echo "usage: $0 off|on|size" >&2
    exit 2
    ;;
esac
