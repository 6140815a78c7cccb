#!/usr/bin/env bash
# Reproduce workload W1 on the lent H100: vlmserve vs `python -m mlx_vlm.server`, same model, one run.
# On this machine:   GPU_EXTRA_WHEELS="mlx-audio cryptography cffi pycparser websockets opentelemetry-api importlib-metadata" bash ../shared/gpu/stage.sh
# GPU command 1:     bash .gpu-a/device-setup.sh a
# GPU command 2:     bash .gpu-b/device-setup.sh b && bash scripts/bench_gpu.sh
# Results (JSON, PNG, server logs) land in $OUT (default /root/bench, or the run tool's $OUT).
set -euo pipefail
export PYTHONPATH=/root/site:$PWD/src
MODEL=${MODEL:-/root/models/qwen2-vl-2b-bf16}
OUT=${OUT:-/root/bench}
LEVELS=${LEVELS:-1,8,32,64}
PEER=${PEER:-1}
mkdir -p "$OUT"
if [ ! -f "$MODEL/config.json" ]; then
  python3 scripts/make_fixtures.py --preset qwen2-vl-2b --dtype bfloat16 --out "$MODEL"
fi

wait_ready() {  # url pid name
  for _ in $(seq 1 600); do
    kill -0 "$2" 2>/dev/null || { echo "$3 died"; tail -40 "$OUT/$3.log"; exit 1; }
    curl -sf "$1" >/dev/null && return 0
    sleep 0.5
  done
  echo "$3 not ready"; exit 1
}

setsid python3 -m vlmserve.cli serve "$MODEL" --port 8100 --max-num-seqs 64 ${VLMSERVE_ARGS:-} > "$OUT/vlmserve.log" 2>&1 &
VPID=$!
t0=$(date +%s.%N)
wait_ready http://127.0.0.1:8100/ready $VPID vlmserve
echo "vlmserve ready in $(echo "$(date +%s.%N) - $t0" | bc) s"
ARGS=(--url http://127.0.0.1:8100 --label vlmserve --concurrency "$LEVELS" --out "$OUT/w1.json" --plot "$OUT/w1.png")
if [ "$PEER" = 1 ]; then
  setsid python3 -m mlx_vlm.server --model "$MODEL" --port 8200 > "$OUT/mlx_vlm.log" 2>&1 &
  PPID_=$!
  wait_ready http://127.0.0.1:8200/health $PPID_ mlx_vlm
  ARGS+=(--peer-url http://127.0.0.1:8200 --peer-label mlx-vlm-0.7.10 --peer-model "$MODEL")
fi
python3 scripts/bench.py "${ARGS[@]}" || true
kill -- -$VPID 2>/dev/null || true
[ "$PEER" = 1 ] && kill -- -$PPID_ 2>/dev/null || true
tail -5 "$OUT/vlmserve.log"
