# The llama.cpp both peer benchmarks build (sourced by bench/peer-cpu.sh and tools/peer-gpu.sh): the
# llama-cpp-python source distribution on PyPI that vendors it, pinned by version and sha256.
LLAMA_CPP_PYTHON=0.3.36  # vendors ggml-org/llama.cpp@0c1e57098 (its CHANGELOG)
LLAMA_CPP_COMMIT=0c1e57098
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

# llama_cpp_sdist DIR PYTHON: downloads the pinned sdist into DIR unless it is there, checks its sha256, prints its
# path (exit 1 on a mismatch).
llama_cpp_sdist() {
  local dir=$1 python=$2 sdist="$1/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
  if [ ! -f "$sdist" ]; then
    printf 'pip download llama-cpp-python==%s (source distribution)\n' "$LLAMA_CPP_PYTHON" >&2
    "$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$dir" >&2 || return 1
  fi
  echo "$SDIST_SHA256  $sdist" | sha256sum -c --quiet - >&2 || return 1
  echo "$sdist"
}
