#!/usr/bin/env bash
# One binary for machines with and without CUDA (a CUDA build only): kvlite links the CUDA runtime statically and
# reaches the driver by dlopen, so the executable names no CUDA library, starts with the toolkit's libraries out
# of reach, and `auto` picks the GPU where one is visible, else the CPU, saying why.
#   tests/one_binary.sh KVLITE_BINARY
# "Out of reach": the program runs under the dynamic loader with --inhibit-cache (no /etc/ld.so.cache, through
# which /usr/local/cuda's ld.so.conf.d entry reaches libcudart.so) and no LD_LIBRARY_PATH.
set -uo pipefail
binary=$1
model=models/kvlite-captioner-bf16
fail() { echo "one binary: $*"; exit 1; }

needed=$(readelf -d "$binary" | grep '(NEEDED)') || fail "readelf -d $binary failed"
echo "$needed" | grep -E 'libcuda|libcublas|libnv' && fail "$binary needs a CUDA library at load time (above)"
echo "NEEDED entries: $(echo "$needed" | grep -o '\[[^]]*\]' | tr '\n' ' ')"

loader=$(readelf -l "$binary" | grep -o '/[^]]*ld-linux[^]]*') || fail "no program interpreter in $binary"
hidden() { env -u LD_LIBRARY_PATH "$loader" --inhibit-cache "$binary" "$@"; }

plan=$(hidden plan "$model" --no-wsl2 2>&1) || fail "kvlite plan failed with the CUDA libraries hidden: $plan"
line=$(echo "$plan" | grep -m1 ' backend ') || fail "the plan names no backend: $plan"
echo "plan: $line"
if nvidia-smi -L >/dev/null 2>&1; then
  echo "$line" | grep -q 'backend cuda' || fail "a GPU is visible (nvidia-smi) and auto did not pick it"
else
  echo "$line" | grep -q 'backend cpu (auto: no CUDA device is visible (cudaGetDeviceCount: ' ||
    fail "no GPU here: auto must pick the CPU and give the CUDA runtime's reason"
fi
out=$(hidden generate "$model" --prompt "a small red" --max-tokens 4 2>&1) ||
  fail "kvlite generate failed with the CUDA libraries hidden: $out"
echo "$out" | grep -qE '[0-9]+ prompt \+ [1-9][0-9]* generated tokens' || fail "generate generated nothing: $out"
echo "generate: $(echo "$out" | tail -1)"
echo "one binary: ok"
