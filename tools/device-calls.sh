#!/usr/bin/env bash
# Device calls 1 and 2 of tools/README.md in one run, so that one machine start serves both: the tests and
# sanitizers (device-call-1.sh, KVLITE_CALL1_BUDGET_S, default 300 s), then the benchmarks (device-call-2.sh,
# KVLITE_CALL2_BUDGET_S, default 200 s). Each call writes into its own folder; $OUT gets the summaries, the GEMM
# bench's log and gpu-check.md, and every log in logs.tgz (a call brings back at most 8 files).
# With .peer-gpu/llama-src.tar.xz carried (tools/peer-gpu.sh pack; KVLITE_CALL_PEER=0: not), the GPU peer
# benchmark too: its preparation (llama.cpp built for this GPU, the random checkpoints and GGUFs) starts in the
# background, niced, while the two calls run (it needs the CPUs and the disk, never the GPU); its timed runs
# come last, the GPU to themselves, until KVLITE_CALLS_BUDGET_S (default 540 s) from the start -> peer.md.
#
#     tools/device-calls.sh              on the device (run: carry .device-pack and .peer-gpu, or gpu-bundle; timeout_s 560)
#     tools/device-calls.sh --dry-run    anywhere, as device-call-1.sh --dry-run
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
final=${OUT:-$root/build-gpu/calls}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvlite-calls.XXXXXX")
mkdir -p "$final"
status=0
# the packed bundle (tools/pack-gpu-bundle.sh) where gpu-bundle/ did not travel
if [ ! -f "$root/gpu-bundle/MANIFEST" ] && [ -f "$root/.device-pack/gpu-bundle.tar.xz" ]; then
  tar xJf "$root/.device-pack/gpu-bundle.tar.xz" -C "$root"
fi
started=$(date +%s)
peer=0
if [ "${KVLITE_CALL_PEER:-1}" != 0 ] && [ -f "$root/.peer-gpu/llama-src.tar.xz" ] && [ "${1:-}" != --dry-run ]; then
  peer=1
  mkdir -p "$work/peer"
  nice -n 15 "$root/tools/peer-gpu.sh" prepare > "$work/peer/prepare.log" 2>&1 &
  peer_prepare=$!
fi
# KVLITE_CALL1=0 skips call 1 (a follow-up call on kernels the same sources' call 1 already ran)
if [ "${KVLITE_CALL1:-1}" != 0 ]; then
  OUT=$work/call-1 KVLITE_CALL_BUDGET_S=${KVLITE_CALL1_BUDGET_S:-300} "$root/tools/device-call-1.sh" "$@" || status=1
fi
# KVLITE_CALL_PROBE_BUDGET_S > 0: the GEMV probe (device-call-probe.sh) between the two, in that many seconds
if [ "${KVLITE_CALL_PROBE_BUDGET_S:-0}" -gt 0 ]; then
  OUT=$work/probe KVLITE_CALL_BUDGET_S=$KVLITE_CALL_PROBE_BUDGET_S "$root/tools/device-call-probe.sh" "$@" || status=1
fi
OUT=$work/call-2 KVLITE_CALL_BUDGET_S=${KVLITE_CALL2_BUDGET_S:-200} "$root/tools/device-call-2.sh" "$@" || status=1
if [ $peer = 1 ]; then
  deadline=$((started + ${KVLITE_CALLS_BUDGET_S:-540}))
  left=$((deadline - $(date +%s)))
  if [ $left -gt 30 ]; then
    PEER_GPU_DEADLINE=$deadline timeout -k 5 $left "$root/tools/peer-gpu.sh" bench "$work/peer" > "$work/peer/bench.log" 2>&1 ||
      status=1
  else
    echo "peer benchmark: SKIPPED, $left s left" > "$work/peer/peer.md"
  fi
  kill $peer_prepare 2>/dev/null
  cp "${PEER_GPU_WORK:-/tmp/peer-gpu}"/*.log "$work/peer/" 2>/dev/null  # prepare's logs (peer-gpu.sh's work folder)
  # cut off by the deadline: the table of the rows already timed
  [ -s "$work/peer/peer.md" ] || [ ! -f "$work/peer/runs.tsv" ] ||
    "$root/tools/peer-gpu.sh" table "$work/peer" > "$work/peer/peer.md" 2>&1
fi
for file in peer/peer.md call-1/call-1.md probe/probe.md call-2/call-2.md call-2/gpu-check.md call-2/bench-quant_gemm.log \
            call-2/bench-quant_gemm-baseline.log; do
  [ -f "$work/$file" ] && cp "$work/$file" "$final/"
done
tar czf "$final/logs.tgz" -C "$work" .
rm -rf "$work"
# the summaries last, where the run tool's output_tail shows them
for file in call-1.md call-2.md peer.md; do [ -f "$final/$file" ] && { echo "=== $file"; cat "$final/$file"; }; done
exit $status
