#!/usr/bin/env bash
# Device probe for issue 13's GEMV gap: why the decode GEMVs read W4A16 at 22-62% of copy bandwidth, and as slowly on
# an H200 as on an H100. Ends inside KVLITE_CALL_BUDGET_S (default 120 s), each step bounded, results under $OUT:
#   1. bench-gemv_stream: the GEMVs' load pattern alone (no math; then with a dequantize-sized load of FP ops)
#      against a flat read of the same bytes, per real shape and per warps / tiles in flight; the cost of a
#      CUDA-graph node, plain and with programmatic dependent launch                          -> probe.md
#   2. Nsight Compute (--clock-control none: the card's clocks as found) on one warm launch of the kernel the
#      automatic choice runs at M = 1, for Llama-3.1-8B's gate_up and qkv (W4A16: gemv_mma; qkv is split-K) and
#      Qwen3-VL-4B's gate_up (FP8: gemv_a16): DRAM throughput, occupancy, registers, issue activity, and the
#      warp stall reasons, the instruction mix; with KVLITE_BASELINE (a folder holding lib/libkvlite.so built
#      otherwise), gate_up through that library too                                             -> ncu.log, probe.md
#   3. cuobjdump: the GEMVs' SASS and resource usage                           -> gemv.sass, gemv-resources.txt
#
#     tools/device-call-probe.sh              on the device (tools/device-calls.sh runs it when
#                                             KVLITE_CALL_PROBE_BUDGET_S > 0)
#     tools/device-call-probe.sh --dry-run    anywhere (the benches say "no CUDA GPU"; ncu is skipped)
set -uo pipefail
call_name=probe
source "$(dirname "$0")/device-call-common.sh"
machine_summary
choose_binaries bench-gemv_stream bench-quant_gemm

stream_log="$out/gemv_stream.log"
run_step "bench-gemv_stream" 60 "$stream_log" "$build/bench-gemv_stream"
# the tables themselves into the summary (the reply carries call summaries, not logs)
{ echo '```'; grep -v '^====' "$stream_log"; echo '```'; } >> "$summary"

ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ $dry_run = 1 ] || [ -z "$ncu" ]; then
  note "- ncu: not run ($([ $dry_run = 1 ] && echo 'dry run' || echo 'not found'))"
else
  ncu_log="$out/ncu.log"
  sections=(--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
            --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats)
  for target in "int4 llama gate_up" "int4 llama qkv" "fp8 qwen gate_up"; do
    read -r format model layer <<< "$target"
    # launch 1 validates (cold); launch 2 is the timing's warm-up: the one profiled
    run_step "ncu: $format $model $layer, M = 1" 40 "$ncu_log" \
      "$ncu" --clock-control none -k regex:quant_gemv --launch-skip 1 --launch-count 1 "${sections[@]}" \
      --print-details all "$build/bench-quant_gemm" --format "$format" --model "$model" --layer "$layer" --rows 1
  done
  # KVLITE_BASELINE (a library built otherwise, e.g. -DKVLITE_GEMV_MIN_BLOCKS=3): its gate_up GEMV too
  for baseline in ${KVLITE_BASELINE:-}; do
    [ -f "$baseline/lib/libkvlite.so" ] || continue
    run_step "ncu: int4 llama gate_up, M = 1, library $baseline/lib" 40 "$ncu_log" \
      env LD_LIBRARY_PATH="$baseline/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      "$ncu" --clock-control none -k regex:quant_gemv --launch-skip 1 --launch-count 1 "${sections[@]}" \
      --print-details all "$build/bench-quant_gemm" --format int4 --model llama --layer gate_up --rows 1
  done
  # the lines that answer the question, per profile, into the summary
  { echo '```'
    grep -E '^==== ncu|quant_gemv.*\(|DRAM Throughput|Memory Throughput|Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers|Grid Size|Waves Per SM|Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|Warp Cycles Per Issued|Active Warps Per Scheduler|Eligible Warps Per Scheduler|[Ss]tall|L1/TEX Hit|L2 Hit' "$ncu_log" | cut -c1-150
    echo '```'; } >> "$summary"
fi
# The GEMVs' machine code and resources (for instruction counts per tile): into logs.tgz, not the summary.
cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
if [ $dry_run = 0 ] && [ -n "$cuobjdump" ] && [ -f "$build/lib/libkvlite.so" ]; then
  "$cuobjdump" -sass "$build/lib/libkvlite.so" 2>&1 |
    awk '/Function : /{keep = ($0 ~ /quant_gemv/)} keep' > "$out/gemv.sass"
  "$cuobjdump" -res-usage "$build/lib/libkvlite.so" 2>&1 | grep -A1 quant_gemv > "$out/gemv-resources.txt"
  note "- cuobjdump: $(grep -c 'Function : ' "$out/gemv.sass") GEMV functions disassembled (gemv.sass in logs.tgz)"
fi
note "- total: $(elapsed) s; steps not ok: $failed_steps"
[ $failed_steps = 0 ]
