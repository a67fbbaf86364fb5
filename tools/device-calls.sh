#!/usr/bin/env bash
# Device calls 1 and 2 of tools/README.md in one run, so that one machine start serves both: the tests and
# sanitizers (device-call-1.sh, KVLITE_CALL1_BUDGET_S, default 300 s), then the benchmarks (device-call-2.sh,
# KVLITE_CALL2_BUDGET_S, default 200 s). Each call writes into its own folder; $OUT gets the summaries, the GEMM
# bench's log and gpu-check.md, and every log in logs.tgz (a call brings back at most 8 files).
#
#     tools/device-calls.sh              on the device (run: carry gpu-bundle; timeout_s 560)
#     tools/device-calls.sh --dry-run    anywhere, as device-call-1.sh --dry-run
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
final=${OUT:-$root/build-gpu/calls}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvlite-calls.XXXXXX")
mkdir -p "$final"
status=0
# KVLITE_CALL1=0 skips call 1 (a follow-up call on kernels the same sources' call 1 already ran)
if [ "${KVLITE_CALL1:-1}" != 0 ]; then
  OUT=$work/call-1 KVLITE_CALL_BUDGET_S=${KVLITE_CALL1_BUDGET_S:-300} "$root/tools/device-call-1.sh" "$@" || status=1
fi
# KVLITE_CALL_PROBE_BUDGET_S > 0: the GEMV probe (device-call-probe.sh) between the two, in that many seconds
if [ "${KVLITE_CALL_PROBE_BUDGET_S:-0}" -gt 0 ]; then
  OUT=$work/probe KVLITE_CALL_BUDGET_S=$KVLITE_CALL_PROBE_BUDGET_S "$root/tools/device-call-probe.sh" "$@" || status=1
fi
OUT=$work/call-2 KVLITE_CALL_BUDGET_S=${KVLITE_CALL2_BUDGET_S:-200} "$root/tools/device-call-2.sh" "$@" || status=1
for file in call-1/call-1.md probe/probe.md call-2/call-2.md call-2/gpu-check.md call-2/bench-quant_gemm.log \
            call-2/bench-quant_gemm-baseline.log; do
  [ -f "$work/$file" ] && cp "$work/$file" "$final/"
done
tar czf "$final/logs.tgz" -C "$work" .
rm -rf "$work"
exit $status
