#!/usr/bin/env bash
# README.md's no-CMake recipes, run exactly as written: its `app.cpp` block and the ```sh block under "CPU only"
# (cpu) or under "With the CUDA backend" (cuda), in a scratch directory with KVLITE= this checkout; then the app
# must caption scene_1.png as the captioner does (on the CPU: the CUDA build picks the CPU where no GPU is).
#   tests/readme_recipes.sh cpu|cuda        (from the repository root)
set -uo pipefail
mode=$1
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
case "$mode" in
  cpu) heading='^CPU only' ;;
  cuda) heading='^With the CUDA backend' ;;
  *) echo "usage: $0 cpu|cuda"; exit 2 ;;
esac
awk '/^```cpp$/ { inside = 1; next } /^```/ { if (inside) exit } inside { print }' README.md > "$work/app.cpp"
head -n 1 "$work/app.cpp" | grep -q '^// app.cpp' || { echo "README.md's first \`\`\`cpp block is not app.cpp"; exit 1; }
# The first ```sh block after the heading's paragraph.
awk -v heading="$heading" '$0 ~ heading { found = 1 } found && /^```sh$/ { inside = 1; next }
                           inside && /^```/ { exit } inside { print }' README.md > "$work/recipe.sh"
[ -s "$work/recipe.sh" ] || { echo "README.md has no recipe under /$heading/"; exit 1; }
echo "--- recipe ($mode), run in a scratch directory with KVLITE=$root:"
cat "$work/recipe.sh"
(cd "$work" && KVLITE="$root" bash -e -x recipe.sh) || { echo "the $mode recipe failed"; exit 1; }
expected=$(grep '^scene_1.png' examples/images/captions.txt | cut -f2)
caption=$("$work/app" models/kvlite-captioner-bf16 examples/images/scene_1.png)
status=$?
echo "caption: $caption (exit $status; expected: $expected)"
[ "$status" -eq 0 ] && [ "$caption" = "$expected" ]
