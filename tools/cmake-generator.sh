#!/usr/bin/env bash
# The generator flag for configuring BUILD_DIR: "-G Ninja" for a new directory when ninja is installed, else
# nothing (CMake's default, Unix Makefiles; a directory configured already must keep the generator it has).
#   cmake -S . -B build $(tools/cmake-generator.sh build) ...
# Ninja compiles a target's objects while the libraries it links are still building; the Makefiles generator
# waits for each whole target, so every test suite waited on kernels.cu (CI, 2026-11-28: 14 of its 41 minutes).
if [ ! -f "${1:?usage: tools/cmake-generator.sh BUILD_DIR}/CMakeCache.txt" ] && command -v ninja > /dev/null; then
  echo "-G Ninja"
fi
