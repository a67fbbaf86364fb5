#!/usr/bin/env bash
# Prints one hash of every file that goes into the compiled binaries (CMake files, the header, src/, kernels.cu,
# tests/, examples/, bench/ sources), from the files' contents alone: the device machine gets a working tree
# without .git, so a commit id cannot say there whether gpu-bundle/ was built from these sources.
#   tools/source-stamp.sh            (run from anywhere; hashes the checkout it lives in)
set -euo pipefail
cd "$(dirname "$0")/.."
{
  ls CMakeLists.txt tests/CMakeLists.txt kvlite.hpp kernels.cu
  find src tests examples bench -maxdepth 1 -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \)
} | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
