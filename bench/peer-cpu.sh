#!/usr/bin/env bash
# bench/peer-cpu.sh: kvlite against llama.cpp on the CPU, the same random weights in both (issue 45).
#
#   bench/peer-cpu.sh            everything: prepare, then the timed runs and the ratio table
#   bench/peer-cpu.sh prepare    everything but the timed runs (deps, llama.cpp, kvlite, checkpoints, GGUFs)
#   bench/peer-cpu.sh bench      the timed runs (after prepare) and the table
#   bench/peer-cpu.sh table DIR  the table again from a results directory's runs.tsv
#
# What it does, on a fresh Debian machine (root or sudo for apt-get; PyPI reachable):
#   1. Debian packages: kvlite's (tools/install-deps.sh) and python3-venv, xz-utils
#   2. llama-cpp-python's source distribution from PyPI, pinned (LLAMA_CPP_PYTHON in bench/llama-cpp-pin.sh, sha256 checked): it
#      vendors llama.cpp under vendor/llama.cpp; llama-bench and llama-quantize built from it with CMake + Ninja
#      (GGML_NATIVE, OpenMP, no curl / OpenSSL)
#   3. kvlite's CLI (build-cpu/, Release, no CUDA) unless $KVLITE names one
#   4. random-weight checkpoints of the real shapes (tools/make_random_checkpoint.py): BF16, W8A16 (int8 channel)
#      and W4A16 (int4 g128), for Qwen3-0.6B and Llama-3.2-1B
#   5. the BF16 checkpoint converted by llama.cpp's own convert_hf_to_gguf.py to GGUF BF16 (through
#      bench/peer_convert.py: the Llama checkpoint's fixture tokenizer has no known pre-tokenizer hash), then
#      llama-quantize to Q8_0 and Q4_0: the same weights, llama.cpp's formats
#   6. interleaved timed runs, $PEER_REPEATS rounds per (model, format, threads): kvlite bench --backend cpu
#      with each --cpu-kernels set (fast: the reference's numbers; fast-lowp: llama.cpp's, int8 / bf16 activations), and llama-bench (pp128 at depth 0, tg64 at depth 128: kvlite's
#      decode runs after its 128-token prompt), the order reversed every other round
#   7. bench/peer_table.py: medians, ratios kvlite / llama.cpp (prefill 128, decode 64) and kvlite's % of its
#      memory roofline; raw outputs kept in $PEER_WORK/results/<UTC time>/
#
# Pairings: BF16 vs BF16, W8A16 vs Q8_0, W4A16 g128 vs Q4_0. Not part of make test.
#
# Environment (defaults in brackets):
#   PEER_WORK     downloads, builds, checkpoints, results [.peer/ in the repository, ignored by git]
#   PEER_MODELS   [qwen3-0.6b llama-3.2-1b]      PEER_FORMATS  [bf16 w8 w4]      PEER_THREADS  [1 2]
#   PEER_REPEATS  rounds [3]                       PEER_KERNELS  kvlite's CPU kernel sets [fast fast-lowp
#                 fast-lowp+int8head] (+int8head: with --cpu-lm-head int8, the output matrix in int8 as
#                 llama.cpp stores it; reference too when named: it takes minutes a run)
#   PEER_JOBS     build jobs [nproc]               KVLITE        a kvlite binary [build-cpu/kvlite, built]
#   PEER_NO_AMX   1: llama.cpp without its AMX kernels (-mno-amx-*), for a CPU or VM whose AMX state faults [0]
#   PEER_PYTHON   a Python with numpy, torch and transformers to convert with (sentencepiece is added under
#                 $PEER_WORK/pylib when missing) [none: a venv in $PEER_WORK/venv with llama.cpp's own pinned
#                 requirements-convert_hf_to_gguf.txt, torch from PyTorch's CPU index as that file says]
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/llama-cpp-pin.sh"  # LLAMA_CPP_PYTHON, LLAMA_CPP_COMMIT, llama_cpp_sdist
SENTENCEPIECE=0.2.1
PROMPT=128
DECODE=64

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${PEER_WORK:-$repo/.peer}
models=${PEER_MODELS:-qwen3-0.6b llama-3.2-1b}
formats=${PEER_FORMATS:-bf16 w8 w4}
threads=${PEER_THREADS:-1 2}
repeats=${PEER_REPEATS:-3}
kernels=${PEER_KERNELS:-fast fast-lowp fast-lowp+int8head}
jobs=${PEER_JOBS:-$(nproc)}
kvlite=${KVLITE:-$repo/build-cpu/kvlite}
src=$work/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp
# PEER_NO_AMX=1: llama.cpp built without its AMX kernels, in its own build directory. On a Sapphire Rapids VM
# (2026-12-03) GGML_NATIVE's AMX Q8_0 kernel died on `tilezero` with SIGILL; bench's smoke run says so.
no_amx=${PEER_NO_AMX:-0}
llama_build=$work/llama-build$([ "$no_amx" = 1 ] && echo -noamx)
step=${1:-all}

log() { printf '[peer-cpu %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# kvlite's names for the formats, llama.cpp's, and make_random_checkpoint.py's --quant
kv_quant() { case $1 in bf16) echo none ;; w8) echo w8a16 ;; w4) echo w4a16 ;; *) echo "unknown format $1" >&2; exit 2 ;; esac; }
gguf_type() { case $1 in bf16) echo BF16 ;; w8) echo Q8_0 ;; w4) echo Q4_0 ;; esac; }

debian_deps() {
  "$repo/tools/install-deps.sh"
  local need=()
  python3 -c "import ensurepip" >/dev/null 2>&1 || need+=(python3-venv)
  command -v xz >/dev/null || need+=(xz-utils)
  [ ${#need[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" != 0 ] && sudo=sudo
  log "installing Debian packages: ${need[*]}"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

python_env() {  # sets $py (and PYTHONPATH for the PEER_PYTHON case)
  if [ -n "${PEER_PYTHON:-}" ]; then
    py=$PEER_PYTHON
    if ! "$py" -c "import sentencepiece" 2>/dev/null; then
      [ -d "$work/pylib/sentencepiece" ] ||
        "$py" -m pip install -q --target "$work/pylib" "sentencepiece==$SENTENCEPIECE"
      export PYTHONPATH=$work/pylib${PYTHONPATH:+:$PYTHONPATH}
    fi
  else
    py=$work/venv/bin/python
    [ -x "$py" ] || python3 -m venv "$work/venv"
  fi
}

fetch_llama_cpp() {
  local sdist
  sdist=$(llama_cpp_sdist "$work/dl" "$py") || exit 1
  [ -f "$src/CMakeLists.txt" ] || tar xzf "$sdist" -C "$work"
  if [ -z "${PEER_PYTHON:-}" ] && [ ! -f "$work/venv/.requirements-done" ]; then
    log "installing llama.cpp's converter requirements into $work/venv"
    (cd "$src" && "$py" -m pip install -q -r requirements/requirements-convert_hf_to_gguf.txt)
    touch "$work/venv/.requirements-done"
  fi
}

build_llama_cpp() {
  if [ ! -x "$llama_build/bin/llama-bench" ] || [ ! -x "$llama_build/bin/llama-quantize" ]; then
    log "building llama.cpp $LLAMA_CPP_COMMIT: llama-bench, llama-quantize (-j$jobs)"
    local amx_flags=()
    [ "$no_amx" = 1 ] && amx_flags=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                                     -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    cmake -S "$src" -B "$llama_build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
      "${amx_flags[@]}" \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON \
      -DLLAMA_BUILD_COMMIT=$LLAMA_CPP_COMMIT -DLLAMA_BUILD_NUMBER=0 >"$work/llama-cmake.log"
    cmake --build "$llama_build" -j"$jobs" --target llama-bench llama-quantize >"$work/llama-build.log"
  fi
}

build_kvlite() {
  [ -x "$kvlite" ] && return 0
  [ -n "${KVLITE:-}" ] && { echo "KVLITE=$KVLITE is not an executable" >&2; exit 2; }
  log "building kvlite (build-cpu, Release, no CUDA; -j$jobs)"
  cmake -S "$repo" -B "$repo/build-cpu" -G Ninja -DKVLITE_CUDA=OFF -DCMAKE_BUILD_TYPE=Release >"$work/kvlite-cmake.log"
  cmake --build "$repo/build-cpu" -j"$jobs" --target kvlite >"$work/kvlite-build.log"
}

checkpoints() {
  local model fmt q dir
  for model in $models; do
    for fmt in bf16 $formats; do
      q=$(kv_quant "$fmt")
      dir=$work/models/$model-$q
      [ -f "$dir/model.safetensors" ] && continue
      log "random checkpoint $model ($q)"
      "$py" "$repo/tools/make_random_checkpoint.py" "$model" "$dir" --quant "$q"
    done
  done
}

# The BF16 checkpoint's config and weights with a tokenizer llama.cpp's converter takes: Qwen3's real one
# (tests/fixtures/tokenizers/qwen3-real; the converter knows its hash), Llama 3's fixture (llama-bpe forced).
ggufs() {
  local model hf out fmt pre
  for model in $models; do
    hf=$work/hf/$model
    mkdir -p "$hf" "$work/gguf"
    ln -sf "$work/models/$model-none/config.json" "$work/models/$model-none/model.safetensors" "$hf/"
    case $model in
      qwen3-*) tar xJf "$repo/tests/fixtures/tokenizers/qwen3-real/tokenizer.tar.xz" -C "$hf"; pre= ;;
      llama-*) cp "$repo/tests/fixtures/models/tiny-llama3/tokenizer.json" \
                  "$repo/tests/fixtures/models/tiny-llama3/tokenizer_config.json" "$hf/"; pre=llama-bpe ;;
      *) echo "no tokenizer for $model" >&2; exit 2 ;;
    esac
    out=$work/gguf/$model-BF16.gguf
    if [ ! -f "$out" ]; then
      log "convert_hf_to_gguf.py $model -> BF16"
      PEER_TOKENIZER_PRE=$pre "$py" "$repo/bench/peer_convert.py" "$src" "$hf" --outtype bf16 \
        --outfile "$out.part" >"$work/convert-$model.log" 2>&1 || { tail -20 "$work/convert-$model.log" >&2; exit 1; }
      mv "$out.part" "$out"
    fi
    for fmt in $formats; do
      [ "$fmt" = bf16 ] && continue
      out=$work/gguf/$model-$(gguf_type "$fmt").gguf
      [ -f "$out" ] && continue
      log "llama-quantize $model -> $(gguf_type "$fmt")"
      "$llama_build/bin/llama-quantize" "$work/gguf/$model-BF16.gguf" "$out.part" "$(gguf_type "$fmt")" \
        "$jobs" >"$work/quantize-$model-$fmt.log" 2>&1 || { tail -20 "$work/quantize-$model-$fmt.log" >&2; exit 1; }
      mv "$out.part" "$out"
    done
  done
}

prepare() {
  mkdir -p "$work/dl"
  debian_deps
  python_env
  fetch_llama_cpp
  build_llama_cpp
  build_kvlite
  checkpoints
  ggufs
}

run_kvlite() {  # model fmt threads kernels[+int8head] round -> one runs.tsv row
  local model=$1 fmt=$2 t=$3 k=$4 r=$5 raw head=stored
  case $k in *+int8head) head=int8 ;; esac
  raw=$out/kvlite-$model-$fmt-t$t-$k-r$r.txt
  "$kvlite" bench "$work/models/$model-$(kv_quant "$fmt")" --backend cpu --threads "$t" --batch 1 \
    --prompt-tokens $PROMPT --decode-tokens $DECODE --cpu-kernels "${k%+int8head}" --cpu-lm-head $head \
    >"$raw" 2>&1 || { cat "$raw" >&2; exit 1; }
  python3 "$repo/bench/peer_table.py" --kvlite "$raw" | sed "s/^/$model\t$fmt\t$t\tkvlite-$k\t$r\t/" >>"$out/runs.tsv"
}

run_llama() {
  local model=$1 fmt=$2 t=$3 r=$4 gguf raw
  gguf=$work/gguf/$model-$(gguf_type "$fmt").gguf
  raw=$out/llama-$model-$fmt-t$t-r$r
  "$llama_build/bin/llama-bench" -m "$gguf" -t "$t" -p $PROMPT -n 0 -r 1 -o json >"$raw-pp.json" 2>"$raw-pp.err" ||
    { cat "$raw-pp.err" >&2; exit 1; }
  "$llama_build/bin/llama-bench" -m "$gguf" -t "$t" -p 0 -n $DECODE -d $PROMPT -r 1 -o json >"$raw-tg.json" \
    2>"$raw-tg.err" || { cat "$raw-tg.err" >&2; exit 1; }
  python3 "$repo/bench/peer_table.py" --llama "$raw-pp.json" "$raw-tg.json" |
    sed "s/^/$model\t$fmt\t$t\tllama.cpp\t$r\t/" >>"$out/runs.tsv"
}

bench() {
  python_env
  out=$work/results/$(date -u +%Y%m%dT%H%M%SZ)
  mkdir -p "$out"
  {
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), family $(lscpu | sed -n 's/^CPU family: *//p') model $(lscpu | sed -n 's/^Model: *//p') ($(nproc) CPUs; $(lscpu | sed -n 's/^Flags: *//p' | tr ' ' '\n' | grep -E '^avx512(f|bw|vl|_bf16|_vnni)$|^avx2$' | tr '\n' ' '))"
    echo "kvlite: $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD -- kvlite.hpp src || echo ' (modified)')"
    echo "llama.cpp: $LLAMA_CPP_COMMIT (llama-cpp-python $LLAMA_CPP_PYTHON sdist; Release, GGML_NATIVE, OpenMP$([ "$no_amx" = 1 ] && echo ', AMX off: PEER_NO_AMX'))"
    echo "compiler: $(c++ --version | head -1); memory: $(free -g | awk '/^Mem:/{print $2}') GiB"
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "models: $models; formats: $formats; threads: $threads; rounds: $repeats; kernels: $kernels"
  } >"$out/meta.txt"
  cat "$out/meta.txt" >&2
  local gguf_file rc
  for model in $models; do  # a smoke run of each GGUF first: a crash says what to change, not a half table
    for fmt in $formats; do
      gguf_file=$work/gguf/$model-$(gguf_type "$fmt").gguf
      rc=0
      "$llama_build/bin/llama-bench" -m "$gguf_file" -t 1 -p 8 -n 0 -r 1 >/dev/null 2>"$out/smoke.err" || rc=$?
      if [ "$rc" != 0 ]; then
        log "llama-bench on $gguf_file exited $rc$([ "$rc" = 132 ] && echo ' (SIGILL: an instruction this CPU or VM refuses; AMX here once: prepare and bench again with PEER_NO_AMX=1)')"
        exit 1
      fi
    done
  done
  printf 'model\tformat\tthreads\tengine\tround\tprefill_tok_s\tdecode_tok_s\troofline_pct\tcopy_gb_s\tweight_bytes\n' >"$out/runs.tsv"
  local model fmt t r k engines order e
  for model in $models; do
    for fmt in $formats; do
      for t in $threads; do
        for r in $(seq 1 "$repeats"); do
          engines=""  # kvlite-<first kernels> llama.cpp kvlite-<the others>
          for k in $kernels; do
            engines="$engines kvlite-$k"
            [ "$k" = "${kernels%% *}" ] && engines="$engines llama.cpp"
          done
          order=$engines
          [ $((r % 2)) = 0 ] && order=$(echo $engines | tr ' ' '\n' | tac | tr '\n' ' ')
          for e in $order; do
            log "$model $fmt t=$t round $r: $e"
            case $e in
              llama.cpp) run_llama "$model" "$fmt" "$t" "$r" ;;
              kvlite-*) run_kvlite "$model" "$fmt" "$t" "${e#kvlite-}" "$r" ;;
            esac
          done
        done
      done
    done
  done
  echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/meta.txt"
  python3 "$repo/bench/peer_table.py" --table "$out" | tee "$out/table.md"
  log "raw outputs: $out"
}

case $step in
  all) prepare; bench ;;
  prepare) prepare ;;
  bench) bench ;;
  table) python3 "$repo/bench/peer_table.py" --table "${2:?table DIR}" ;;
  *) echo "usage: bench/peer-cpu.sh [all|prepare|bench|table DIR]" >&2; exit 2 ;;
esac
