#!/usr/bin/env bash
# Packs what a device call runs of gpu-bundle/ (tools/build-gpu-bundle.sh) into .device-pack/gpu-bundle.tar.xz:
# the GPU suites, kvlite, caption_image, the GPU benches and lib/ (the CPU suites stay behind: CI runs them, and a
# tree trimmed by tools/device-trim.sh lacks their fixtures). 38 MB becomes ~8 MB, which with the trimmed tree and
# .peer-gpu/ fits the 64 MiB a call carries; tools/device-calls.sh unpacks it when gpu-bundle/ is absent there.
#     tools/build-gpu-bundle.sh && tools/pack-gpu-bundle.sh && tools/device-trim.sh off
#     run: command "tools/device-calls.sh", carry [".device-pack", ".peer-gpu"]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -f gpu-bundle/MANIFEST ] || { echo "pack-gpu-bundle: no gpu-bundle/ (tools/build-gpu-bundle.sh)" >&2; exit 1; }
mkdir -p .device-pack
grep -qx '/.device-pack/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null ||
  echo '/.device-pack/' >> "$(git rev-parse --git-path info/exclude)"
files=(gpu-bundle/MANIFEST gpu-bundle/kvlite gpu-bundle/caption_image gpu-bundle/bench-quant_gemm
       gpu-bundle/bench-gemv_stream gpu-bundle/bench-speculative gpu-bundle/lib gpu-bundle/libkvlite.so)
for suite in test-cuda-ops test-cuda-quant test-cuda-host test-quant-gpu-host test-cuda-engine; do
  files+=(gpu-bundle/tests/$suite)
done
tar cf - "${files[@]}" | xz -9 -T0 > .device-pack/gpu-bundle.tar.xz.part
mv .device-pack/gpu-bundle.tar.xz.part .device-pack/gpu-bundle.tar.xz
echo "pack-gpu-bundle: .device-pack/gpu-bundle.tar.xz $(du -h .device-pack/gpu-bundle.tar.xz | cut -f1) ($(sed -n 's/^stamp //p' gpu-bundle/MANIFEST))"
