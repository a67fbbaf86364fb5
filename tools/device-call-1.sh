#!/usr/bin/env bash
# Device call 1 of issue 13: every GPU test with the GPU required, then compute-sanitizer over them; ends inside
# KVLITE_CALL_BUDGET_S (540 s) of the 600 s a call may run, each step bounded, results under $OUT as they come:
#   1. machine: GPU, driver, nvcc, compute-sanitizer, glibc                                     -> call-1.md
#   2. binaries: gpu-bundle/ (carried) when built from these sources for this GPU, else built here (~4-7 min)
#   3. the GPU suites with KVLITE_REQUIRE_GPU=1 (no GPU = failure): test-cuda-ops, test-cuda-quant,
#      test-cuda-host, test-quant-gpu-host, then test-cuda-engine alone (it measures device memory)  -> tests.log
#   4. compute-sanitizer: memcheck over test-cuda-ops, test-cuda-engine (less the case that measures device
#      memory) and the GEMV, split-K and fused-Linear cases of test-cuda-quant; racecheck and synccheck over its
#      quantized GEMM cases (mma paths, split-K counters, cp.async stages, the GEMV) and over test-cuda-ops'
#      attention cases (shared-memory merges)                                                    -> sanitizer.log
#   5. the demo with every caption on the GPU (KVLITE_DEMO_BACKEND=cuda tools/demo.sh), then kvlite bench on the
#      bundled captioner (BF16, CUDA graphs), for the flagship's tokens/s                         -> demo.log
#   6. with the time left: every other suite through ctest (CPU ones; they also run in CI)       -> tests.log
#
# Switches for a short call: KVLITE_CALL1_SANITIZE=0 skips step 4 (KVLITE_CALL1_RACECHECK=0 its racecheck and
# synccheck of the GEMMs, KVLITE_CALL1_ATTENTION_RACECHECK=0 those of attention, KVLITE_CALL1_OPS_MEMCHECK=0 its
# memcheck of test-cuda-ops), KVLITE_CALL1_EXTRAS=0 steps 5 and 6, KVLITE_CALL1_CPU_SUITES=0 step 6.
#
#     tools/device-call-1.sh              on the device (the run tool: see tools/README.md for command and carry)
#     tools/device-call-1.sh --dry-run    anywhere: the same steps, GPU not required, no sanitizers
#                                         (tools/simulate-device.sh runs it without the -dev files)
set -uo pipefail
call_name=call-1
source "$(dirname "$0")/device-call-common.sh"
machine_summary
choose_binaries test-cuda-ops test-cuda-quant test-cuda-host test-quant-gpu-host test-cuda-engine kvlite

if [ $dry_run = 1 ]; then export KVLITE_REQUIRE_GPU=0; else export KVLITE_REQUIRE_GPU=1; fi
tests_log="$out/tests.log"
for suite in test-cuda-ops test-cuda-quant test-cuda-host test-quant-gpu-host test-cuda-engine; do
  limit=120
  [ $suite = test-cuda-engine ] && limit=180
  run_step "$suite (KVLITE_REQUIRE_GPU=$KVLITE_REQUIRE_GPU)" $limit "$tests_log" "$build/tests/$suite" --no-intro
done

sanitizer_log="$out/sanitizer.log"
sanitize() {  # sanitize TOOL SECONDS SUITE [doctest filters...]
  local tool=$1 limit=$2 suite=$3
  shift 3
  run_step "compute-sanitizer --tool $tool $suite $*" "$limit" "$sanitizer_log" \
    "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 100 "$build/tests/$suite" --no-intro "$@"
}
# On PATH, or where CUDA toolkits put it.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
  /usr/local/cuda*/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)
# 6 cases: the mma paths, the staged (cp.async) copy, split-K, the GEMV
# (KVLITE_CALL1_RACECHECK_CASES='-tc=*GEMV*' narrows them to the kernels a change touched)
quant_gemm_cases=${KVLITE_CALL1_RACECHECK_CASES:-'-tc=*mma*,*split-K*,*staged*,*GEMV*'}

if [ $dry_run = 1 ]; then
  note "- compute-sanitizer: not run (dry run)"
elif [ "${KVLITE_CALL1_SANITIZE:-1}" = 0 ]; then
  note "- compute-sanitizer: not run (KVLITE_CALL1_SANITIZE=0)"
elif [ -z "$sanitizer" ]; then
  note "- compute-sanitizer: NOT FOUND (PATH, /usr/local/cuda*/bin, /usr/local/cuda*/compute-sanitizer, /opt/nvidia)"
  failed_steps=$((failed_steps + 1))
else
  note "- compute-sanitizer: $sanitizer"
  # KVLITE_CALL1_MEMCHECK="test-cuda-ops ...": memcheck over those suites only (a short call after a change that
  # touched only their kernels); KVLITE_CALL1_OPS_MEMCHECK=0 drops test-cuda-ops from the default three
  memcheck_suites=" ${KVLITE_CALL1_MEMCHECK:-test-cuda-ops test-cuda-engine test-cuda-quant} "
  [ "${KVLITE_CALL1_OPS_MEMCHECK:-1}" = 0 ] && memcheck_suites=${memcheck_suites/ test-cuda-ops / }
  for suite in test-cuda-ops test-cuda-engine test-cuda-quant; do
    if [[ "$memcheck_suites" != *" $suite "* ]]; then
      note "- memcheck $suite: not run (KVLITE_CALL1_MEMCHECK / KVLITE_CALL1_OPS_MEMCHECK)"
      continue
    fi
    case $suite in
      test-cuda-ops) sanitize memcheck 120 test-cuda-ops ;;
      # (the case that measures the process's device memory against the plan: the sanitizer's own memory counts there)
      test-cuda-engine) sanitize memcheck 150 test-cuda-engine '-tce=*device memory measured*' ;;
      test-cuda-quant) sanitize memcheck 120 test-cuda-quant '-tc=*GEMV*,*split-K*,*fused*' ;;
    esac
  done
  if [ "${KVLITE_CALL1_RACECHECK:-1}" = 0 ]; then
    note "- racecheck, synccheck: not run (KVLITE_CALL1_RACECHECK=0: no GEMM kernel changed since they last ran)"
  else
    sanitize racecheck 120 test-cuda-quant "$quant_gemm_cases"
    sanitize synccheck 90 test-cuda-quant "$quant_gemm_cases"
  fi
  # the attention kernels' shared-memory merges (the warps' softmax partials, once per head) and barriers;
  # KVLITE_CALL1_ATTENTION_RACECHECK=0 skips them
  if [ "${KVLITE_CALL1_ATTENTION_RACECHECK:-1}" = 0 ]; then
    note "- racecheck, synccheck of test-cuda-ops' attention cases: not run (KVLITE_CALL1_ATTENTION_RACECHECK=0)"
  else
    sanitize racecheck 120 test-cuda-ops '-tc=*attention*'
    sanitize synccheck 90 test-cuda-ops '-tc=*attention*'
  fi
fi

if [ "${KVLITE_CALL1_EXTRAS:-1}" = 0 ]; then
  note "- the demo, the captioner bench and the CPU suites: not run (KVLITE_CALL1_EXTRAS=0)"
  note "- total: $(elapsed) s; steps not ok: $failed_steps"
  [ $failed_steps = 0 ]
  exit
fi
demo_log="$out/demo.log"
run_step "the demo on the GPU (KVLITE_DEMO_BACKEND=cuda tools/demo.sh)" 90 "$demo_log" \
  env KVLITE_DEMO_BACKEND=cuda tools/demo.sh "$build"
run_step "kvlite bench models/kvlite-captioner-bf16 --backend cuda" 60 "$demo_log" \
  "$build/kvlite" bench models/kvlite-captioner-bf16 --backend cuda --batch 1,8 --prompt-tokens 64 --decode-tokens 64

# The CPU suites (and the header / README checks) with whatever time is left; a build here has only the GPU
# suites, so this is for the bundle. (Not the openai client's test: the bundle records this machine's Python
# with the openai package, which the device lacks, so ctest reports it "Not Run" there.)
# KVLITE_CALL1_CPU_SUITES=0: not (a tree trimmed by tools/device-trim.sh lacks their fixtures)
if [ "${KVLITE_CALL1_CPU_SUITES:-1}" = 0 ]; then
  note "- ctest of the CPU suites: not run (KVLITE_CALL1_CPU_SUITES=0)"
elif [ "$build" = /tmp/kvlite-bundle/build ]; then
  run_step "ctest: every other suite" 240 "$tests_log" \
    bash -c "cd '$build' && ctest -j 8 --output-on-failure -E '^(cuda-engine|cuda-ops|cuda-quant|cuda-host|quant-gpu-host|cmake|readme|header):|openai Python client'"
fi
note "- total: $(elapsed) s; steps not ok: $failed_steps"
[ $failed_steps = 0 ]
