#!/usr/bin/env bash
# libkvlite.so as a distribution would ship it: it exports the C API and nothing else (every kvlite_* function
# c_api.h declares, no C++ symbol), carries the soname libkvlite.so.<major>, and `cmake --install` puts it, the
# header and kvlite.pc under a prefix from which a C program built with pkg-config's flags alone runs without
# LD_LIBRARY_PATH.
#   tests/shared_library.sh CC BUILD_DIR LIBKVLITE_SO    (from the repository root)
set -uo pipefail
cc=$1
build=$2
library=$3
fail() { echo "FAILED: $*"; exit 1; }

declared=$(grep -oE '\bkvlite_[a-z_]+\(' src/c_api.h | tr -d '(' | sort -u)
exported=$(nm -D --defined-only "$library" | awk '$2 ~ /^[TW]$/ { print $3 }' | sort -u)
echo "exported: $(echo "$exported" | wc -l) symbols; c_api.h declares $(echo "$declared" | wc -l) functions"
extra=$(comm -13 <(echo "$declared") <(echo "$exported"))
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
[ -z "$extra" ] || fail "exported beyond the C API: $(echo "$extra" | head -5 | tr '\n' ' ')..."
[ -z "$missing" ] || fail "C API functions not exported: $missing"

soname=$(readelf -d "$library" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
echo "soname: $soname"
[[ $soname =~ ^libkvlite\.so\.[0-9]+$ ]] || fail "soname '$soname' is not libkvlite.so.<major>"

prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix/usr" > "$prefix/install.log" 2>&1 || { cat "$prefix/install.log"; fail "cmake --install"; }
for file in include/kvlite.hpp lib/libkvlite.so "lib/$soname" lib/pkgconfig/kvlite.pc lib/cmake/kvlite/kvliteConfig.cmake; do
  [ -e "$prefix/usr/$file" ] || fail "cmake --install did not install $file"
done
awk '/^```c$/ { inside = 1; next } /^```/ { if (inside) exit } inside { print }' README.md > "$prefix/caption.c"
flags=$(PKG_CONFIG_PATH="$prefix/usr/lib/pkgconfig" pkg-config --cflags --libs kvlite) || fail "pkg-config kvlite"
echo "pkg-config: $flags"
"$cc" -std=c11 "$prefix/caption.c" $flags -o "$prefix/caption" || fail "building the README's C program with pkg-config"
expected=$(grep '^scene_1.png' examples/images/captions.txt | cut -f2)
caption=$(env -u LD_LIBRARY_PATH "$prefix/caption" models/kvlite-captioner-bf16 examples/images/scene_1.png)
status=$?
echo "caption: $caption (exit $status)"
[ "$status" -eq 0 ] && [ "$caption" = "$expected" ] || fail "the installed program's caption"
resolved=$(env -u LD_LIBRARY_PATH ldd "$prefix/caption" | grep libkvlite)
echo "ldd: $resolved"
[[ $resolved == *"$prefix/usr/lib/"* ]] || fail "the program did not load the installed libkvlite.so"
