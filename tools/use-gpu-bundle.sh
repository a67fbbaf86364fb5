#!/usr/bin/env bash
# Makes the prebuilt binaries of gpu-bundle/ (tools/build-gpu-bundle.sh) usable on this machine, when they were
# built from exactly these sources (tools/source-stamp.sh) for ARCH: links /tmp/kvlite-bundle/src to the
# repository and /tmp/kvlite-bundle/build to gpu-bundle/ (the paths compiled into the tests), then checks that
# every binary's libraries resolve. Exit 0: use /tmp/kvlite-bundle/build as the build directory; stdout then
# holds directories to put first on LD_LIBRARY_PATH (where cuBLAS was found outside the loader's paths), or
# nothing. Exit 1: build instead; stderr says why.
#     if extra=$(tools/use-gpu-bundle.sh 90); then export LD_LIBRARY_PATH=$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
arch=${1:-}
bundle="$root/gpu-bundle"
say() { echo "use-gpu-bundle: $*" >&2; }

[ -f "$bundle/MANIFEST" ] || { say "no gpu-bundle/ (carry it: tools/build-gpu-bundle.sh makes it)"; exit 1; }
built_stamp=$(awk '$1 == "stamp" { print $2 }' "$bundle/MANIFEST")
built_arch=$(awk '$1 == "arch" { print $2 }' "$bundle/MANIFEST")
stamp=$("$root/tools/source-stamp.sh")
if [ "$built_stamp" != "$stamp" ]; then
  say "gpu-bundle/ was built from other sources (stamp $built_stamp, these are $stamp): rebuild it or build here"
  exit 1
fi
if [ -n "$arch" ] && [ "$built_arch" != "$arch" ]; then
  say "gpu-bundle/ holds sm_$built_arch machine code, this GPU is sm_$arch"
  exit 1
fi
mkdir -p /tmp/kvlite-bundle
ln -sfn "$root" /tmp/kvlite-bundle/src
ln -sfn "$bundle" /tmp/kvlite-bundle/build

binaries=("$bundle"/kvlite "$bundle"/caption_image "$bundle"/bench-* "$bundle"/lib/libkvlite.so
          $(find "$bundle/tests" -maxdepth 1 -type f -name 'test-*' ! -name '*.cmake'))
missing=$(for binary in "${binaries[@]}"; do ldd "$binary"; done 2>&1 | grep -E 'not found|not a dynamic' | sort -u)
extra=""
if echo "$missing" | grep -q 'libcu'; then
  # The CUDA toolkit's libraries outside the loader's paths (a pip-installed toolkit beside torch, say).
  for library in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do
    echo "$missing" | grep -q "$library" || continue
    dir=$(find /usr/local/cuda/ /usr/local/cuda/targets/x86_64-linux/lib/ / -xdev -name "$library" -printf '%h\n' 2>/dev/null | head -1)
    [ -n "$dir" ] && case ":$extra:" in *":$dir:"*) ;; *) extra=${extra:+$extra:}$dir ;; esac
  done
  if [ -n "$extra" ]; then
    missing=$(for binary in "${binaries[@]}"; do LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$binary"; done 2>&1 |
              grep 'not found' | sort -u)
  fi
fi
if [ -n "$missing" ]; then
  say "libraries not found: $(echo "$missing" | tr -s ' \t\n' ' ')"
  exit 1
fi
say "using gpu-bundle/ ($(tr '\n' ';' < "$bundle/MANIFEST"))"
echo "$extra"
