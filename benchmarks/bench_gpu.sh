#!/usr/bin/env bash
# Reproduce workload W1 on the lent H100: vlmserve, then `python -m mlx_vlm.server`, same model,
# one server on the GPU at a time, results in one JSON + PNG.
# On this machine:   GPU_EXTRA_WHEELS="mlx-audio cryptography cffi pycparser websockets opentelemetry-api importlib-metadata" bash ../shared/gpu/stage.sh
# GPU command 1:     bash .gpu-a/device-setup.sh a
# GPU command 2:     bash .gpu-b/device-setup.sh b && bash benchmarks/bench_gpu.sh
# (the wheels for the peer and httptools may not fit beside .gpu-b in 64 MiB: move them to .gpu-c and
#  install them with pip --target /root/site in a call of their own; see docs/benchmarks.md)
# Results (w1.json, w1.png, server logs) land in $OUT (default /root/bench).
set -euo pipefail
export PYTHONPATH=/root/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # keeps extra wheel dirs given by the caller
MODEL=${MODEL:-/root/models/qwen2-vl-2b-bf16}
OUT=${OUT:-/root/bench}
LEVELS=${LEVELS:-1,8,32,64}
PEER=${PEER:-1}
SELF=${SELF:-1}  # SELF=0 PEER=1: only the peer, appended to an existing w1.json (split across device calls)
CLIENTS=${CLIENTS:-4}  # load-generator processes (bench.py --client-processes; one Python process delays W1's waves)
WRAP=${WRAP:-}  # prefix for the vlmserve command, e.g. "py-spy record --gil -f raw -o $OUT/gil.txt --"
mkdir -p "$OUT"
[ "$SELF" = 1 ] && rm -f "$OUT/w1.json"
if [ ! -f "$MODEL/config.json" ]; then
  python3 scripts/make_fixtures.py --preset qwen2-vl-2b --dtype bfloat16 --out "$MODEL"
fi

serve_and_bench() {  # name ready_url port label cmd...
  local name=$1 ready=$2 label=$3; shift 3
  local t0; t0=$(date +%s)
  setsid "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 1200); do
    kill -0 "$pid" 2>/dev/null || { echo "$name died"; tail -40 "$OUT/$name.log"; return 1; }
    curl -sf "$ready" >/dev/null && break
    sleep 0.5
  done
  echo "$name ready after $(( $(date +%s) - t0 )) s"
  python3 benchmarks/bench.py --url "${ready%/*}" --label "$label" --model "$MODEL_ID" --concurrency "$LEVELS" --client-processes "$CLIENTS" \
    --out "$OUT/w1.json" --plot "$OUT/w1.png" --append || true
  kill -INT -- -"$pid" 2>/dev/null || true  # SIGINT: a profiler in WRAP writes its output on the way out
  wait "$pid" 2>/dev/null || true
}

MODEL_ID=$(basename "$MODEL")
[ "$SELF" = 1 ] && serve_and_bench vlmserve http://127.0.0.1:8100/ready vlmserve \
  $WRAP python3 -m vlmserve.cli serve "$MODEL" --port 8100 --max-num-seqs 64 ${VLMSERVE_ARGS:-}
if [ "$PEER" = 1 ]; then
  MODEL_ID=$MODEL
  serve_and_bench mlx_vlm http://127.0.0.1:8200/health mlx-vlm-0.7.10 \
    python3 -m mlx_vlm.server --model "$MODEL" --port 8200
fi
