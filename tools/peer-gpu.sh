#!/usr/bin/env bash
# tools/peer-gpu.sh: kvlite against llama.cpp on the same NVIDIA GPU in the same device call (issue 46).
#
#   tools/peer-gpu.sh pack          here, with PyPI: .peer-gpu/llama-src.tar.xz, the pinned llama.cpp's sources that
#                                   a CUDA build of llama-bench, llama-batched-bench and llama-quantize needs, and its
#                                   converter (~2 MB: the device call carries it; the device has no network)
#   tools/peer-gpu.sh prepare       on the GPU machine (tools/device-calls.sh starts it in the background at the
#                                   call's start, while the GPU suites run): llama.cpp built for this GPU; per model
#                                   a random BF16 checkpoint converted by llama.cpp's convert_hf_to_gguf.py and
#                                   quantized by llama-quantize to Q4_0 and Q4_K_M, and kvlite's W4A16 g128 checkpoint
#                                   of the same shapes; each model marked ready in turn
#   tools/peer-gpu.sh bench DIR     the timed runs of each model once prepare has made it ready (the first is
#                                   timed while the next is prepared), the GPU to themselves; DIR/runs.tsv, DIR/peer.md
#   tools/peer-gpu.sh table DIR     DIR/peer.md again from DIR/runs.tsv
#
# What is timed, per model (batch 1 and 8, prompt 512, decode 128, flash attention on, every layer on the GPU):
#   kvlite     kvlite bench W4A16 --backend cuda --device-mem 8GiB --batch 1,8 --prompt-tokens 512 --decode-tokens 128
#              (prefill: 512 over batch 1's time to first token; decode: tokens after the first over their time)
#   llama.cpp  llama-bench -p 512 (prefill), llama-bench -n 128 -d 512 (batch 1 decode at depth 512),
#              llama-batched-bench -npp 512 -ntg 128 -npl 8 (batch 8 decode: speed_tg, all 8 sequences)
# The weights are random (speed depends on shapes and formats only): kvlite's W4A16 codes and llama.cpp's BF16
# weights are drawn separately (tools/make_random_checkpoint.py), the same shapes, not the same values.
#
# Environment: PEER_GPU_MODELS ["llama-3.2-3b llama-3.1-8b"], PEER_GPU_TYPES [Q4_0 Q4_K_M], PEER_GPU_WORK [/tmp/
# peer-gpu], PEER_GPU_ROUNDS [2, each round in the other order; a round is skipped when PEER_GPU_DEADLINE (epoch
# seconds) would pass], KVLITE [the bundle's kvlite, else build-gpu/kvlite], PEER_PYTHON [python3], PEER_JOBS [nproc].
# A check of the script itself where there is no GPU (no figure from it means anything):
#   PEER_GPU_LLAMA_BUILD=<a CPU build of the pack> PEER_GPU_LAYERS=1 PEER_GPU_KVLITE_BACKEND=cpu PEER_GPU_NGL=0
set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/../bench/llama-cpp-pin.sh"  # the llama.cpp bench/peer-cpu.sh builds too
PROMPT=512
DECODE=128

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pack_file=$repo/.peer-gpu/llama-src.tar.xz
work=${PEER_GPU_WORK:-/tmp/peer-gpu}
models=${PEER_GPU_MODELS:-llama-3.2-3b llama-3.1-8b}
types=${PEER_GPU_TYPES:-Q4_0 Q4_K_M}
rounds=${PEER_GPU_ROUNDS:-2}
py=${PEER_PYTHON:-python3}
jobs=${PEER_JOBS:-$(nproc)}
src=$work/llama.cpp
llama_build=${PEER_GPU_LLAMA_BUILD:-$work/llama-build}
# for a check of this script on a machine without a GPU: a CPU build of llama.cpp, fewer layers, kvlite on the CPU
layers=${PEER_GPU_LAYERS:+--layers $PEER_GPU_LAYERS}
kvlite_backend=${PEER_GPU_KVLITE_BACKEND:-cuda}
ngl=${PEER_GPU_NGL:-99}
step=${1:-}

log() { printf '[peer-gpu %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

pack() {
  local dl=$repo/.peer/dl sdist staging keep
  mkdir -p "$dl" "$repo/.peer-gpu"
  grep -qx '/.peer-gpu/' "$(git -C "$repo" rev-parse --git-path info/exclude)" 2>/dev/null ||
    echo '/.peer-gpu/' >> "$(git -C "$repo" rev-parse --git-path info/exclude)"
  sdist=$(llama_cpp_sdist "$dl" "$py") || exit 1
  staging=$(mktemp -d)
  tar xzf "$sdist" -C "$staging"
  cd "$staging/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" || exit 1
  # Only the three tools are configured (the others pull in mtmd's and the server's sources, 1.6 MB of the pack),
  # and vendor/ without miniaudio (mtmd's); the sources compiled are llama.cpp's own, unchanged.
  printf '# tools/peer-gpu.sh pack: the three tools the GPU peer benchmark runs\nllama_add_compile_flags()\n%s\n' \
    'add_subdirectory(batched-bench)' 'add_subdirectory(llama-bench)' 'add_subdirectory(quantize)' > tools/CMakeLists.txt
  sed -i '/add_subdirectory(miniaudio)/d' vendor/CMakeLists.txt
  keep=(CMakeLists.txt cmake ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src/*.c ggml/src/*.cpp ggml/src/*.h
        ggml/src/*.in ggml/src/CMakeLists.txt ggml/src/ggml-cpu ggml/src/ggml-cuda ggml/src/ggml-blas src include
        common tools/CMakeLists.txt tools/batched-bench tools/llama-bench tools/quantize vendor/CMakeLists.txt
        vendor/cpp-httplib vendor/hash vendor/nlohmann vendor/sheredom vendor/stb gguf-py conversion
        convert_hf_to_gguf.py LICENSE licenses)
  tar cf - "${keep[@]}" | xz -9 -T0 > "$pack_file.part" && mv "$pack_file.part" "$pack_file"
  cd "$repo" && rm -rf "$staging"
  log "wrote $pack_file ($(du -h "$pack_file" | cut -f1)): llama.cpp $LLAMA_CPP_COMMIT from llama-cpp-python $LLAMA_CPP_PYTHON"
}

gpu_arch() { nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .'; }

build_llama() {
  if [ -n "${PEER_GPU_LLAMA_BUILD:-}" ]; then log "llama.cpp: $llama_build (PEER_GPU_LLAMA_BUILD)"; return 0; fi
  local arch
  arch=$(gpu_arch)
  arch=${arch:-${PEER_GPU_ARCH:-90}}
  mkdir -p "$src"
  # (the converter's files are already there, and may be running)
  tar xJf "$pack_file" -C "$src" --exclude=convert_hf_to_gguf.py --exclude=conversion --exclude=gguf-py || return 1
  log "building llama.cpp $LLAMA_CPP_COMMIT for sm_$arch (CUDA, -j$jobs)"
  cmake -S "$src" -B "$llama_build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch-real" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_COMMIT=$LLAMA_CPP_COMMIT -DLLAMA_BUILD_NUMBER=0 \
    > "$work/llama-cmake.log" 2>&1 || { log "llama.cpp cmake failed (llama-cmake.log)"; return 1; }
  cmake --build "$llama_build" -j"$jobs" --target llama-bench llama-batched-bench llama-quantize \
    > "$work/llama-build.log" 2>&1 || { log "llama.cpp build failed (llama-build.log)"; return 1; }
  log "llama.cpp built"
}

free_gb() { df -BG --output=avail "$work" | tail -1 | tr -dc 0-9; }

# checkpoint MODEL: the BF16 checkpoint through convert_hf_to_gguf.py (then deleted), kvlite's W4A16 checkpoint.
checkpoint() {
  local model=$1 hf=$work/hf-$model need
  need=$([ "$model" = llama-3.1-8b ] && echo 40 || echo 16)  # BF16 safetensors + BF16 GGUF + the rest, GB
  if [ "$(free_gb)" -lt "$need" ]; then log "$model: $(free_gb) GB free, $need needed: skipped"; return 1; fi
  log "$model: random BF16 checkpoint"
  "$py" "$repo/tools/make_random_checkpoint.py" "$model" "$hf" $layers > "$work/checkpoint-$model.log" 2>&1 || return 1
  log "$model: convert_hf_to_gguf.py -> BF16"
  PEER_TOKENIZER_PRE=llama-bpe "$py" "$repo/bench/peer_convert.py" "$src" "$hf" --outtype bf16 \
    --outfile "$work/$model-BF16.gguf" > "$work/convert-$model.log" 2>&1 || { log "$model: convert failed"; return 1; }
  rm -rf "$hf"
  log "$model: kvlite's W4A16 g128 checkpoint"
  "$py" "$repo/tools/make_random_checkpoint.py" "$model" "$work/$model-w4a16" --quant w4a16 $layers \
    >> "$work/checkpoint-$model.log" 2>&1
}

quantize() {
  local model=$1 type
  for type in $types; do
    log "$model: llama-quantize -> $type"
    "$llama_build/bin/llama-quantize" "$work/$model-BF16.gguf" "$work/$model-$type.gguf" "$type" $((jobs / 2 + 1)) \
      > "$work/quantize-$model-$type.log" 2>&1 || { log "$model: llama-quantize $type failed"; return 1; }
  done
  rm -f "$work/$model-BF16.gguf"
}

prepare() {
  mkdir -p "$work"
  rm -f "$work"/*.ready "$work"/*.failed "$work"/*.converted
  [ -f "$pack_file" ] || { log "no $pack_file (tools/peer-gpu.sh pack, then carry .peer-gpu)"; touch "$work/llama.failed"; exit 1; }
  # the converter needs only the sources: it runs while llama.cpp builds
  mkdir -p "$src" && tar xJf "$pack_file" -C "$src" convert_hf_to_gguf.py conversion gguf-py
  (build_llama && touch "$work/llama.ready" || touch "$work/llama.failed") &
  # the checkpoints and conversions, one model after the other, beside the build
  (for model in $models; do
     checkpoint "$model" && touch "$work/$model.converted" || touch "$work/$model.failed"
   done) &
  local model
  for model in $models; do  # each model quantized once both are there
    while [ ! -f "$work/llama.ready" ] && [ ! -f "$work/llama.failed" ]; do sleep 2; done
    while [ ! -f "$work/$model.converted" ] && [ ! -f "$work/$model.failed" ]; do sleep 2; done
    if [ -f "$work/llama.ready" ] && [ -f "$work/$model.converted" ] && quantize "$model"; then
      touch "$work/$model.ready"
    else
      touch "$work/$model.failed"
    fi
  done
  wait
  log "prepare done"
}

kvlite_binary() {  # sets $kvlite (and LD_LIBRARY_PATH for the bundle's CUDA libraries)
  local extra
  if [ -n "${KVLITE:-}" ]; then
    kvlite=$KVLITE
  elif extra=$("$repo/tools/use-gpu-bundle.sh" "$(gpu_arch)" 2>/dev/null); then
    kvlite=/tmp/kvlite-bundle/build/kvlite
    [ -n "$extra" ] && export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  else
    kvlite=$repo/build-gpu/kvlite
  fi
}

time_left() { [ -z "${PEER_GPU_DEADLINE:-}" ] && echo 100000 || echo $(( PEER_GPU_DEADLINE - $(date +%s) )); }

run_kvlite() {  # model round
  local model=$1 r=$2 raw=$out/kvlite-$1-r$2.txt
  log "$model round $r: kvlite W4A16"
  timeout 150 $kvlite bench "$work/$model-w4a16" --backend $kvlite_backend --device-mem 8GiB --batch 1,8 \
    --prompt-tokens $PROMPT --decode-tokens $DECODE > "$raw" 2>&1 || { log "kvlite failed: $(tail -3 "$raw")"; return 1; }
  "$py" "$repo/tools/peer_gpu_table.py" --kvlite "$raw" | sed "s/^/$model\tW4A16\tkvlite\t$r\t/" >> "$out/runs.tsv"
}

run_llama() {  # model type round
  local model=$1 type=$2 r=$3 gguf=$work/$1-$2.gguf raw=$out/llama-$1-$2-r$3
  log "$model round $r: llama.cpp $type"
  timeout 100 "$llama_build/bin/llama-bench" -m "$gguf" -ngl $ngl -fa on -p $PROMPT -n 0 -r 3 -o json \
    > "$raw-pp.json" 2> "$raw-pp.err" || { log "llama-bench pp failed: $(tail -3 "$raw-pp.err")"; return 1; }
  timeout 100 "$llama_build/bin/llama-bench" -m "$gguf" -ngl $ngl -fa on -p 0 -n $DECODE -d $PROMPT -r 3 -o json \
    > "$raw-tg.json" 2> "$raw-tg.err" || { log "llama-bench tg failed: $(tail -3 "$raw-tg.err")"; return 1; }
  timeout 100 "$llama_build/bin/llama-batched-bench" -m "$gguf" -ngl $ngl -fa on -c $((8 * (PROMPT + DECODE))) \
    -b 2048 -ub 512 -npp $PROMPT -ntg $DECODE -npl 8 --output-format jsonl > "$raw-b8.jsonl" 2> "$raw-b8.err" ||
    { log "llama-batched-bench failed: $(tail -3 "$raw-b8.err")"; return 1; }
  "$py" "$repo/tools/peer_gpu_table.py" --llama "$raw-pp.json" "$raw-tg.json" "$raw-b8.jsonl" |
    sed "s/^/$model\t$type\tllama.cpp\t$r\t/" >> "$out/runs.tsv"
}

bench() {
  out=${1:?tools/peer-gpu.sh bench DIR}
  mkdir -p "$out"
  kvlite_binary
  {
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1)"
    echo "cpu: $(lscpu | sed -n 's/^Model name: *//p') ($(nproc) CPUs)"
    echo "kvlite: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown) ($kvlite)"
    echo "llama.cpp: $LLAMA_CPP_COMMIT (llama-cpp-python $LLAMA_CPP_PYTHON sdist; CUDA sm_$(gpu_arch)-real, Release, -ngl $ngl -fa on)"
    echo "models: $models; llama.cpp types: $types; prompt $PROMPT, decode $DECODE; kvlite W4A16 g128, --device-mem 8GiB"
  } > "$out/meta.txt"
  printf 'model\tformat\tengine\tround\tprefill_tok_s\tdecode1_tok_s\tdecode8_tok_s\troofline1_pct\tcopy_gb_s\tweight_bytes\n' > "$out/runs.tsv"
  local r order e
  for r in $(seq 1 "$rounds"); do
    for model in $models; do
      # the first model is timed while the next is still being prepared: wait for each in turn
      while [ ! -f "$work/$model.ready" ] && [ ! -f "$work/$model.failed" ] && [ "$(time_left)" -gt 75 ]; do sleep 2; done
      if [ ! -f "$work/$model.ready" ]; then
        [ "$r" = 1 ] && echo "$model: not ready ($(time_left) s left; ($(ls "$work/$model".* 2>/dev/null | xargs -r -n1 basename | tr '\n' ' '); see prepare.log)" >> "$out/meta.txt"
        continue
      fi
      # a round of one model takes ~60 s (4 model loads of llama.cpp, one of kvlite): skip it when it would not end in time
      if [ "$(time_left)" -lt 75 ]; then echo "round $r of $model: skipped ($(time_left) s left)" >> "$out/meta.txt"; continue; fi
      order="kvlite $types"
      [ $((r % 2)) = 0 ] && order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
      for e in $order; do
        case $e in
          kvlite) run_kvlite "$model" "$r" ;;
          *) run_llama "$model" "$e" "$r" ;;
        esac
      done
    done
  done
  "$py" "$repo/tools/peer_gpu_table.py" --table "$out" > "$out/peer.md"
  cat "$out/peer.md"
}

case $step in
  pack) pack ;;
  prepare) prepare ;;
  bench) shift; bench "$@" ;;
  table) "$py" "$repo/tools/peer_gpu_table.py" --table "${2:?tools/peer-gpu.sh table DIR}" ;;
  *) sed -n '2,25p' "$0"; exit 2 ;;
esac
