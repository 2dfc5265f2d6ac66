#!/usr/bin/env bash
# Served decode throughput on the K3 ep16-rank slice (issue 9's serving figure), on the GPU machine from a carried
# bundle: writes the slice once (kept in $BG_BENCH_MODEL), serves it on CUDA and runs the same workload (64 concurrent
# streamed completions of 64-token prompts, 64 new tokens each; greedy) from scripts/load_async.py (one asyncio thread,
# three rounds) and then from ../shared/tools/load.py (one thread per request; both copied into the bundle). Output in
# $OUT/load.txt (docs/PERF.md, "Served throughput").
#   scripts/gpu-load-check.sh [BUNDLE] [CONCURRENCY] [MAX_TOKENS]     (BG_SERVE_ARGS: more serve options; BG_LOAD_TAG:
#                                                                      suffix of the output files)
set -u
BUNDLE=${1:-.gpu}
CONC=${2:-64}
MAXT=${3:-64}
OUT=${OUT:-$PWD/gpu-out}
PORT=${BG_PORT:-8410}
MODEL=${BG_BENCH_MODEL:-/tmp/bg-ep16-rank}
LOAD=${BG_LOAD_SCRIPT:-$BUNDLE/load.py}
mkdir -p "$OUT"
SP=/opt/torch/.venv/lib/python3.12/site-packages
export LD_LIBRARY_PATH="$BUNDLE/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
if [[ ! -f "$MODEL/model.safetensors.index.json" ]]; then
  "$BUNDLE/batchgen" make-random --arch kimi_k3 --preset ep16-rank --out "$MODEL" --force 2> "$OUT/make-random-ep16.log"
fi
"$BUNDLE/batchgen" serve "$MODEL" --device cuda --port "$PORT" --served-model-name k3 --max-num-seqs "$CONC" \
  --max-model-len 1024 ${BG_SERVE_ARGS:-} > "$OUT/serve-load${BG_LOAD_TAG:-}.log" 2>&1 &
server=$!
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$PORT/ready" > /dev/null && break; sleep 0.5; done
LOG="$OUT/load${BG_LOAD_TAG:-}.txt"
{ python3 "$BUNDLE/load_async.py" "$PORT" "$CONC" "$MAXT" 3; echo "load_async rc=$?"
  python3 "$LOAD" "$PORT" "$CONC" "$MAXT" | tail -1; echo "load.py rc=$?"; } > "$LOG" 2>&1
kill "$server"; wait "$server" 2> /dev/null
cat "$LOG"
