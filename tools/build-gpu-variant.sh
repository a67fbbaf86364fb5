#!/usr/bin/env bash
# Builds a variant of the GPU bundle's library: kernels.cu compiled with the bundle's own command line plus the
# given -D flags, linked with the bundle's other object, in build-variant-NAME/ (git-ignored) beside the bundle's
# kvlite and bench-quant_gemm, so that one device call times the variant against the sources it came from:
#
#     tools/build-gpu-bundle.sh                                        (first: the bundle and its build tree)
#     tools/build-gpu-variant.sh unroll8 -DKVLITE_GEMV_INT4_UNROLL=8   (~3 min: kernels.cu for the bundle's arch)
#     ... KVLITE_BASELINE="$PWD/build-variant-unroll8 $PWD/build-variant-other" tools/device-calls.sh
#
# The folder is what device-call-2.sh (bench-quant_gemm at the decode rows), gpu-check.sh (kvlite bench on each
# checkpoint) and device-call-probe.sh (ncu of gate_up) take as a baseline: kvlite, bench-quant_gemm, lib/ with
# libkvlite.so and the non-CUDA libraries. The build knobs are the ones kernels.cu reads from the preprocessor
# (KVLITE_GEMV_MIN_BLOCKS, KVLITE_GEMV_INT4_UNROLL, ...); anything else a variant needs is a source change.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 2 ] || { echo "usage: tools/build-gpu-variant.sh NAME -DFLAG[=VALUE]..." >&2; exit 2; }
name=$1
shift
work="$root/build-bundle"
out="$root/build-variant-$name"
[ -f "$work/build.ninja" ] && [ -d "$root/gpu-bundle" ] || { echo "no bundle build: run tools/build-gpu-bundle.sh first" >&2; exit 1; }
[ -e /tmp/kvlite-bundle/src ] || { echo "/tmp/kvlite-bundle/src is missing: run tools/build-gpu-bundle.sh first" >&2; exit 1; }

cd "$work"
compile=$(ninja -t commands libkvlite.so | grep -- '-c /tmp/kvlite-bundle/src/kernels.cu')
link=$(ninja -t commands libkvlite.so | grep -- '-shared')
[ -n "$compile" ] && [ -n "$link" ] || { echo "could not read the bundle's kernels.cu / link commands" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/lib"
# the bundle's compile line: its dependency-file flags dropped, the object redirected, the variant's flags added
compile=$(sed -E 's# -MD -MT [^ ]+ -MF [^ ]+##; s# -o CMakeFiles/kvlite_library.dir/kernels.cu.o# -o '"$out"'/kernels.cu.o#' <<< "$compile")
started=$(date +%s)
echo "building $out ($*)"
eval "nice $compile $*"
link=$(sed -E 's#CMakeFiles/kvlite_library.dir/kernels.cu.o#'"$out"'/kernels.cu.o#; s#-o libkvlite.so #-o '"$out"'/lib/libkvlite.so #' <<< "$link")
eval "$link"
rm "$out/kernels.cu.o"
strip "$out/lib/libkvlite.so"
for file in "$root"/gpu-bundle/lib/*; do
  [ "$(basename "$file")" = libkvlite.so ] || cp "$file" "$out/lib/"
done
cp "$root/gpu-bundle/kvlite" "$root/gpu-bundle/bench-quant_gemm" "$out/"
{
  echo "variant $name: $*"
  cat "$root/gpu-bundle/MANIFEST"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) in $(( $(date +%s) - started )) s"
} > "$out/MANIFEST"
du -sh "$out"
