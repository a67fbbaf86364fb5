#!/usr/bin/env bash
# README.md's C API example is a real C11 program: its ```c block compiles warning-free under strict flags, and the
# README's command line (the ```sh block after it) builds and runs it as written -- with LIBKVLITE_SO's directory
# for build-lib/, and no LD_LIBRARY_PATH: the rpath it names finds libkvlite.so -- captioning scene_1.png as the
# captioner must.
#   tests/readme_c_example.sh CC LIBKVLITE_SO    (from the repository root)
set -uo pipefail
cc=$1
library=$2
libdir=$(cd "$(dirname "$library")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
awk '/^```c$/ { inside = 1; next } /^```/ { if (inside) exit } inside { print }' README.md > "$work/caption.c"
[ -s "$work/caption.c" ] || { echo "README.md has no \`\`\`c block"; exit 1; }
"$cc" -std=c11 -Wall -Wextra -Wpedantic -Werror -I. -fsyntax-only "$work/caption.c" || exit 1
# The command: the first line of the ```sh block after the ```c block.
command=$(awk '/^```c$/ { seen = 1 } seen && /^```sh$/ { getline; print; exit }' README.md)
echo "README: $command"
case $command in *LD_LIBRARY_PATH*) echo "the README's command sets LD_LIBRARY_PATH"; exit 1 ;; esac
command=${command//\"\$PWD\/build-lib\"/$libdir}
command=${command//build-lib/$libdir}
command=${command//caption.c/$work/caption.c}
command=${command//-o caption /-o $work/caption }
command=${command//.\/caption /$work/caption }
command=${command//cc -std/$cc -std}
echo "run:    $command"
expected=$(grep '^scene_1.png' examples/images/captions.txt | cut -f2)
caption=$(env -u LD_LIBRARY_PATH bash -c "$command")
status=$?
echo "caption: $caption (exit $status)"
[ "$status" -eq 0 ] && [ "$caption" = "$expected" ]
