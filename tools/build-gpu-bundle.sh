#!/usr/bin/env bash
# Builds here, for one GPU arch (default sm_90: H100 and H200, the device machine's kinds), every binary a GPU
# device call runs -- all test-* suites (test-cuda-* included), the kvlite CLI, caption_image and bench-* -- into
# gpu-bundle/ (git-ignored), which the call `carry`s, so that the call spends its minutes running, not compiling.
#
#     tools/build-gpu-bundle.sh [ARCH]      (ARCH: 90 by default; 12 min from scratch on this shared 2-core machine)
#
# What travels (gpu-bundle/, stripped; `du -sh gpu-bundle` is printed at the end):
#   kvlite caption_image bench-*          the programs
#   tests/test-*                          the doctest suites, plus ctest's files for them (tests/*.cmake)
#   lib/libkvlite.so                      the library, built SHARED (KVLITE_LIBRARY_TYPE) so that the kernels'
#                                         machine code is there once, not in each of ~20 binaries
#   lib/libpcre2-8.so.0 lib/libturbojpeg.so.0 lib/libcpp-httplib.so.0.11 lib/libbrotli*.so.1
#                                         the non-CUDA libraries the device machine lacks
#   MANIFEST                              source stamp (tools/source-stamp.sh), arch, nvcc, glibc needed, commit
# Every binary's RUNPATH is $ORIGIN, $ORIGIN/lib, $ORIGIN/../lib; the CUDA runtime and cuBLAS come from the
# device's own CUDA 13 toolkit (nvcc 13.0 there as here). libstdc++ and glibc are the system's: built on
# Debian 12 (glibc 2.36, GCC 12), so any newer Linux runs them; MANIFEST lists the newest versions needed.
#
# The tests find their fixtures and the CLI through paths compiled in (KVLITE_SOURCE_DIR, KVLITE_BINARY_DIR), so
# the build uses two fixed logical paths that the device call recreates as symbolic links:
#   /tmp/kvlite-bundle/src   -> the repository root
#   /tmp/kvlite-bundle/build -> here the build tree (build-bundle/), on the device gpu-bundle/
# (tools/gpu-bundle-env.sh makes them there; tools/device-call-1.sh and tools/gpu-check.sh call it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
arch=${1:-90}
links=/tmp/kvlite-bundle
work="$root/build-bundle"
bundle="$root/gpu-bundle"
started=$(date +%s)

mkdir -p "$links" "$work"
ln -sfn "$root" "$links/src"
ln -sfn "$work" "$links/build"

# pcre2 and libjpeg-turbo are linked as the system's shared libraries, which are then copied into the bundle
# (1.3 MB), so the build itself is the ordinary one.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$links/src" -B "$links/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DKVLITE_CUDA=ON -DKVLITE_CUDA_ARCHITECTURES="${arch}-real" \
  -DKVLITE_LIBRARY_TYPE=SHARED -DKVLITE_BUILD_TESTS=ON -DKVLITE_BUILD_EXAMPLES=ON \
  '-DCMAKE_BUILD_RPATH=$ORIGIN;$ORIGIN/lib;$ORIGIN/../lib' \
  --no-warn-unused-cli
nice cmake --build "$links/build" -j "${KVLITE_BUNDLE_JOBS:-2}"

# ---- assemble gpu-bundle/ ----------------------------------------------------------------------------------------
rm -rf "$bundle"
mkdir -p "$bundle/lib" "$bundle/tests"
cp "$work"/libkvlite.so "$bundle/lib/"
ln -s lib/libkvlite.so "$bundle/libkvlite.so"  # where the build tree has it (the ctypes example's test loads it there)
for program in "$work"/kvlite "$work"/caption_image "$work"/bench-*; do
  [ -x "$program" ] && cp "$program" "$bundle/"
done
suites=$(find "$work/tests" -maxdepth 1 -type f -name 'test-*' -perm -u+x)
cp $suites "$bundle/tests/"
# ctest's files (doctest_discover_tests wrote one test list per suite), for `ctest` in /tmp/kvlite-bundle/build.
cp "$work"/CTestTestfile.cmake "$bundle/"
cp "$work"/tests/*.cmake "$bundle/tests/"
# The libraries of Debian's -dev packages that the device machine may lack (cpp-httplib, for kvlite serve and its
# tests, brings brotli; OpenSSL and zlib are on every Linux the device runs). The first time without httplib
# here, the device call found kvlite's `libcpp-httplib.so.0.11 => not found` and built everything instead.
for library in libpcre2-8.so.0 libturbojpeg.so.0 libcpp-httplib.so.0.11 libbrotlidec.so.1 libbrotlienc.so.1 \
               libbrotlicommon.so.1; do
  path=$(ldd "$bundle/lib/libkvlite.so" "$bundle/kvlite" | awk -v name="$library" '$1 == name { print $3; exit }')
  [ -n "$path" ] || { echo "build-gpu-bundle: neither libkvlite.so nor kvlite links $library" >&2; exit 1; }
  cp -L "$path" "$bundle/lib/$library"
done
strip --strip-unneeded "$bundle"/kvlite "$bundle"/caption_image "$bundle"/bench-* "$bundle"/lib/*.so* \
  $(find "$bundle/tests" -type f -name 'test-*' -perm -u+x)

needed_glibc=$(objdump -T "$bundle"/lib/*.so* "$bundle"/kvlite $(find "$bundle/tests" -type f -perm -u+x) 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
needed_glibcxx=$(objdump -T "$bundle"/lib/*.so* "$bundle"/kvlite $(find "$bundle/tests" -type f -perm -u+x) 2>/dev/null |
  grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)
{
  echo "stamp $("$root/tools/source-stamp.sh")"
  echo "arch $arch"
  echo "nvcc $(nvcc --version | grep -o 'release [0-9.]*' | cut -d' ' -f2)"
  echo "needs $needed_glibc $needed_glibcxx"
  echo "commit $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD -- . ':!kvlite.hpp' || echo '+changes')"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) in $(( $(date +%s) - started )) s"
} > "$bundle/MANIFEST"
cat "$bundle/MANIFEST"
du -sh "$bundle"
