#!/usr/bin/env bash
# README.md's C API example is a real C11 program: its ```c block, compiled by the C compiler against kvlite.hpp
# and libkvlite.so exactly as the README's command line shows, captions scene_1.png as the captioner must.
#   tests/readme_c_example.sh CC LIBKVLITE_SO    (from the repository root)
set -uo pipefail
cc=$1
library=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
awk '/^```c$/ { inside = 1; next } /^```/ { if (inside) exit } inside { print }' README.md > "$work/caption.c"
[ -s "$work/caption.c" ] || { echo "README.md has no \`\`\`c block"; exit 1; }
"$cc" -std=c11 -Wall -Wextra -Wpedantic -Werror -I. "$work/caption.c" "$library" -o "$work/caption" || exit 1
expected=$(grep '^scene_1.png' examples/images/captions.txt | cut -f2)
caption=$(LD_LIBRARY_PATH="$(dirname "$library")" "$work/caption" models/kvlite-captioner-bf16 examples/images/scene_1.png)
status=$?
echo "caption: $caption (exit $status)"
[ "$status" -eq 0 ] && [ "$caption" = "$expected" ]
