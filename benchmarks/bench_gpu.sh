#!/usr/bin/env bash
# Reproduce the benchmarks on the lent H100: for each model format (bf16, and 4-bit with bf16
# scales made by mlx-vlm's convert), vlmserve, then `python -m mlx_vlm.server`, one server on the
# GPU at a time; each server runs W1 at every level in LEVELS twice (the second pass sends the very
# same requests), then the mixed workload at MIXED_LEVELS three times: the first pass meets every
# shape for the first time, the second sends the very same requests (vlmserve's caches serve much
# of it), the third the same shapes with new pixels and words (no new shape, no cache hit); each
# pass is reported.
# On this machine:   GPU_EXTRA_WHEELS="mlx-audio cryptography cffi pycparser websockets opentelemetry-api importlib-metadata" bash ../shared/gpu/stage.sh
# GPU command 1:     bash .gpu-a/device-setup.sh a
# GPU command 2:     bash .gpu-b/device-setup.sh b && bash benchmarks/bench_gpu.sh
# (the wheels for the peer and httptools may not fit beside .gpu-b in 64 MiB: move them to .gpu-c and
#  install them with pip --target /root/site in a call of their own; see docs/benchmarks.md)
# Results land in $OUT (default /root/bench): <format>-w1.json/.png, <format>-mixed.json, server logs.
# A server it started stops with it, also when the script is stopped (e.g. by `timeout`).
set -euo pipefail
export PYTHONPATH=/root/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # keeps extra wheel dirs given by the caller
MODELS=${MODELS:-/root/models}
FORMATS=${FORMATS:-bf16 4bit}
WORKLOADS=${WORKLOADS-w1 mixed multiturn}  # WORKLOADS= (empty): none, only the starts
OUT=${OUT:-/root/bench}
LEVELS=${LEVELS:-1,8,32,64}
MIXED_LEVELS=${MIXED_LEVELS:-32}
PEER=${PEER:-1}
SELF=${SELF:-1}  # SELF=0 PEER=1: only the peer, appended to existing results (split across device calls)
RESTART=${RESTART:-1}  # RESTART=1: start vlmserve a second time after its run and report when it was ready
FIRST_START=${FIRST_START:-0}  # FIRST_START=1: vlmserve's first start on empty kernel caches (a new machine), then first_use_probe.py
CLIENTS=${CLIENTS:-4}  # load-generator processes (bench.py --client-processes; one Python process delays W1's waves)
WRAP=${WRAP:-}  # prefix for the vlmserve command, e.g. "py-spy record --gil -f raw -o $OUT/gil.txt --"
mkdir -p "$OUT"
SERVER_PGID=""  # the server running now: stopped if this script is stopped (e.g. by `timeout`), so none outlives it
stop_server() { [ -n "$SERVER_PGID" ] && kill -KILL -- -"$SERVER_PGID" 2>/dev/null; SERVER_PGID=""; }
trap stop_server EXIT
trap 'stop_server; exit 143' TERM INT

model_dir() {  # format -> the model directory, built if missing
  local bf16=$MODELS/qwen2-vl-2b-bf16 dir=$MODELS/qwen2-vl-2b-$1
  [ -f "$bf16/config.json" ] || python3 scripts/make_fixtures.py --preset qwen2-vl-2b --dtype bfloat16 --out "$bf16" >&2
  if [ "$1" = 4bit ] && [ ! -f "$dir/config.json" ]; then
    (cd scripts && python3 -c "import sys, make_fixtures as m; from pathlib import Path; m.write_quantized(Path(sys.argv[1]), Path(sys.argv[2]))" "$bf16" "$dir") >&2
  fi
  echo "$dir"
}

serve_and_bench() {  # format name ready_url label model_id cmd...
  local format=$1 name=$2 ready=$3 label=$4 model_id=$5; shift 5
  local t0; t0=$(date +%s)
  setsid "$@" > "$OUT/$format-$name.log" 2>&1 &
  local pid=$!
  SERVER_PGID=$pid
  for _ in $(seq 1 1200); do
    kill -0 "$pid" 2>/dev/null || { echo "$name died"; tail -40 "$OUT/$format-$name.log"; return 1; }
    curl -sf "$ready" >/dev/null && break
    sleep 0.5
  done
  echo "$format $name ready after $(( $(date +%s) - t0 )) s"
  for _ in $(seq 1 600); do  # vlmserve: until the warm-up left after ready is done (background kernels, piece lengths)
    pending=$(curl -sf "${ready%/*}/metrics" | awk '/^vlmserve:warmup_pending/ {print $2}')
    [ -z "$pending" ] || [ "${pending%.*}" = 0 ] && break
    sleep 0.5
  done
  [ -n "$pending" ] && echo "$format $name fully warm after $(( $(date +%s) - t0 )) s"
  if [ "$name" = vlmserve ] && [ "$FIRST_START" = 1 ]; then  # each feature's first request against its second
    python3 benchmarks/first_use_probe.py --url "${ready%/*}" --kernel-cache "$MLX_PTX_CACHE_DIR" \
      --out "$OUT/$format-first-use.json" || true
  fi
  for workload in $WORKLOADS; do
    if [ "$workload" = multiturn ]; then  # 3-turn image chats and 8 questions about one image (TTFT, reuse)
      python3 benchmarks/multiturn.py --url "${ready%/*}" --model "$model_id" --out "$OUT/$format-$name-multiturn.json" || true
      continue
    fi
    # Each workload's first pass meets its requests (and mixed's shapes) first; the second sends the same again.
    local levels=$LEVELS passes=2 plot=(--plot "$OUT/$format-$workload.png")
    if [ "$workload" = mixed ]; then levels=$MIXED_LEVELS passes=3; fi
    python3 benchmarks/bench.py --url "${ready%/*}" --label "$label" --model "$model_id" --workload "$workload" \
      --passes "$passes" --new-content-from 3 --concurrency "$levels" --client-processes "$CLIENTS" \
      --out "$OUT/$format-$workload.json" "${plot[@]}" --append || true
  done
  kill -INT -- -"$pid" 2>/dev/null || true  # SIGINT: a profiler in WRAP writes its output on the way out
  wait "$pid" 2>/dev/null || true
  SERVER_PGID=""
}

for format in $FORMATS; do
  model=$(model_dir "$format")
  [ "$SELF" = 1 ] && rm -f "$OUT/$format"-*.json
  if [ "$FIRST_START" = 1 ]; then  # MLX's and the driver's kernel caches, empty: every kernel is built by this start
    export MLX_PTX_CACHE_DIR=$OUT/kernel-cache-$format CUDA_CACHE_PATH=$OUT/driver-cache-$format
    rm -rf "$MLX_PTX_CACHE_DIR" "$MLX_PTX_CACHE_DIR.staging" "$CUDA_CACHE_PATH"
    mkdir -p "$MLX_PTX_CACHE_DIR" "$CUDA_CACHE_PATH"
  fi
  [ "$SELF" = 1 ] && serve_and_bench "$format" vlmserve http://127.0.0.1:8100/ready vlmserve "$(basename "$model")" \
    $WRAP python3 -m vlmserve.cli serve "$model" --port 8100 --max-num-seqs 64 ${VLMSERVE_ARGS:-}
  if [ "$SELF" = 1 ] && [ "$RESTART" = 1 ]; then  # again, with the kernels the first start built in its cache
    WORKLOADS="" serve_and_bench "$format" vlmserve-restart http://127.0.0.1:8100/ready vlmserve "$(basename "$model")" \
      python3 -m vlmserve.cli serve "$model" --port 8100 --max-num-seqs 64 ${VLMSERVE_ARGS:-}
  fi
  if [ "$PEER" = 1 ]; then
    serve_and_bench "$format" mlx_vlm http://127.0.0.1:8200/health mlx-vlm-0.7.10 "$model" \
      python3 -m mlx_vlm.server --model "$model" --port 8200
  fi
done
