#!/usr/bin/env bash
# Device call 2 of issue 13: the benchmarks; ends inside KVLITE_CALL_BUDGET_S (540 s), each step bounded, results
# under $OUT as they come:
#   1. machine and binaries as in call 1 (gpu-bundle/ when it matches, else bench-quant_gemm and kvlite built here)
#   2. bench-quant_gemm: W4A16 and FP8 GEMMs on Llama-3.1-8B's and Qwen3-VL-4B's Linears, M = 1 .. 2048, against
#      cuBLAS BF16 and the copy bandwidth measured in the same run; one step per format and model, so a cut-off
#      keeps the tables already printed                                                     -> bench-quant_gemm.log
#   3. tools/gpu-check.sh's benchmarks (KVLITE_GPU_CHECK_TESTS=0): kvlite bench on a fixture, then random-weight
#      checkpoints of real shapes planned as an 8 GiB card, skipped past the time left    -> gpu-check.md, bench.log
#
# KVLITE_CALL2_GEMM=0 skips step 2; KVLITE_GPU_CHECK_MODELS (see gpu-check.sh) picks step 3's checkpoints;
# KVLITE_BASELINE="DIR ..." times those builds beside this one (and KVLITE_BASELINE_TESTS=1 tests them first);
# KVLITE_GPU_CHECK_NCU_STEP=1 splits a decode step of each checkpoint into its kernels (gpu-check.sh).
#
#     tools/device-call-2.sh              on the device (see tools/README.md for the run tool's command and carry)
#     tools/device-call-2.sh --dry-run    anywhere: the same steps (the benches say "no CUDA GPU" and stop)
set -uo pipefail
call_name=call-2
source "$(dirname "$0")/device-call-common.sh"
machine_summary
choose_binaries bench-quant_gemm kvlite

bench_log="$out/bench-quant_gemm.log"
[ "${KVLITE_CALL2_GEMM:-1}" = 0 ] && note "- bench-quant_gemm: not run (KVLITE_CALL2_GEMM=0)"
[ "${KVLITE_CALL2_GEMM:-1}" = 0 ] || for format in int4 fp8; do
  for model in llama qwen; do
    # KVLITE_CALL2_GEMM_ROWS="1,2,4,8,16": those rows only (a call that times variants at decode sizes)
    run_step "bench-quant_gemm --format $format --model $model" 100 "$bench_log" \
      "$build/bench-quant_gemm" --format $format --model $model ${KVLITE_CALL2_GEMM_ROWS:+--rows $KVLITE_CALL2_GEMM_ROWS}
  done
done

# KVLITE_BASELINE=DIR (a folder the call carries: bench-quant_gemm, kvlite and lib/ built from an earlier commit by
# the same recipe): the same GEMMs through its bench-quant_gemm at the decode rows, on this machine in this call, so
# that a kernel change is measured against what it replaces (tools/gpu-check.sh runs its kvlite too).
# Several folders, space-separated, are each timed so (tools/build-gpu-variant.sh makes such folders from one -D).
for baseline in ${KVLITE_BASELINE:-}; do
  [ -x "$baseline/bench-quant_gemm" ] && [ "${KVLITE_CALL2_GEMM:-1}" != 0 ] || continue
  # KVLITE_BASELINE_GEMM_ROWS: the rows timed (default the decode ones; 512,2048 for a prefill variant)
  for format in ${KVLITE_BASELINE_FORMATS:-int4 fp8}; do
    run_step "baseline bench-quant_gemm --format $format --rows ${KVLITE_BASELINE_GEMM_ROWS:-1,2,4,8,16} ($baseline)" 100 "$out/bench-quant_gemm-baseline.log" \
      env LD_LIBRARY_PATH="$baseline/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$baseline/bench-quant_gemm" \
      --format $format --rows "${KVLITE_BASELINE_GEMM_ROWS:-1,2,4,8,16}"
  done
done

# KVLITE_BASELINE_TESTS=1: test-cuda-quant (every quantized kernel against the CPU, bit for bit where the contract
# says so) through each baseline's library first, so that a variant's kernels are checked in the call that times
# them (the suite's binary finds libkvlite.so through its RUNPATH, which LD_LIBRARY_PATH overrides).
# This build's own library first (KVLITE_CALL1=0 calls run no other test of it).
for baseline in "$build" ${KVLITE_BASELINE:-}; do
  [ "${KVLITE_BASELINE_TESTS:-0}" = 1 ] && [ -f "$baseline/lib/libkvlite.so" ] && [ $dry_run = 0 ] || continue
  run_step "test-cuda-quant through $baseline/lib" 90 "$out/baseline-tests.log" \
    env KVLITE_REQUIRE_GPU=1 LD_LIBRARY_PATH="$baseline/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$build/tests/test-cuda-quant"
done

left=$(( budget - $(elapsed) - 20 ))
if [ $dry_run = 1 ]; then
  note "- gpu-check.sh benchmarks: not run (dry run: gpu-check.sh needs a GPU)"
elif [ $left -gt 60 ]; then
  # gpu-check.sh's own budget counts from its start: it stops writing checkpoints in time for the last bench; at
  # least 20 s, so that a short call still benches its first checkpoint (a budget of -5 s once skipped them all).
  check_budget=$((left - 90))
  [ $check_budget -lt 20 ] && check_budget=20
  run_step "tools/gpu-check.sh benchmarks (KVLITE_GPU_CHECK_TESTS=0, budget $check_budget s)" "$left" "$out/gpu-check-run.log" \
    env KVLITE_GPU_CHECK_TESTS=0 KVLITE_GPU_CHECK_BUDGET_S=$check_budget tools/gpu-check.sh "$out"
else
  note "- SKIPPED tools/gpu-check.sh benchmarks: ${left} s left"
fi
note "- total: $(elapsed) s; steps not ok: $failed_steps"
[ $failed_steps = 0 ]
