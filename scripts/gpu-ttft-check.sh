#!/usr/bin/env bash
# Time to first token of a lone long prompt served on the K3 ep16-rank slice (CUDA), with serve's default step sizes
# and with --idle-prefill-size 0 (every step at --chunked-prefill-size), from a carried bundle (scripts/gpu-bundle.sh)
# on the GPU machine. Writes the slice once (kept in $BG_BENCH_MODEL). Output: $OUT/ttft.txt (docs/SERVING_ENGINE.md,
# "Step sizes").
#   scripts/gpu-ttft-check.sh [BUNDLE] [PROMPT_TOKENS...]     (default prompts of 8192 and 32768 token ids;
#                                                             BG_TTFT_ROUNDS: measurements of each, default 2)
set -u
BUNDLE=${1:-.gpu}
shift || true
LENGTHS=("${@:-8192 32768}")
OUT=${OUT:-$PWD/gpu-out}
PORT=${BG_PORT:-8420}
MODEL=${BG_BENCH_MODEL:-/tmp/bg-ep16-rank}
mkdir -p "$OUT"
SP=/opt/torch/.venv/lib/python3.12/site-packages
export LD_LIBRARY_PATH="$BUNDLE/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
if [[ ! -f "$MODEL/model.safetensors.index.json" ]]; then
  "$BUNDLE/batchgen" make-random --arch kimi_k3 --preset ep16-rank --out "$MODEL" --force 2> "$OUT/make-random-ep16.log"
fi
LOG="$OUT/ttft.txt"
: > "$LOG"
for mode in default off; do
  args=()
  [[ $mode == off ]] && args=(--idle-prefill-size 0)
  "$BUNDLE/batchgen" serve "$MODEL" --device cuda --port "$PORT" --served-model-name k3 --max-num-seqs 16 \
    --max-model-len 40000 "${args[@]}" > "$OUT/serve-ttft-$mode.log" 2>&1 &
  server=$!
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$PORT/ready" > /dev/null && break; sleep 0.5; done
  for n in ${LENGTHS[*]}; do
    for round in $(seq 1 "${BG_TTFT_ROUNDS:-2}"); do
      python3 - "$PORT" "$n" "$mode" "$round" >> "$LOG" <<'EOF'
import json, sys, time, urllib.request
port, n, mode, rnd = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
# Token ids that differ per mode and round from the first one on: no prefix-cache hit between the measurements.
seed = (1 if mode == "default" else 2) * 10 + int(rnd)
prompt = [(seed * 7919 + i * 31) % 150000 + 100 for i in range(n)]
body = json.dumps({"model": "k3", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
t0 = time.monotonic()
first, usage = None, None
with urllib.request.urlopen(req, timeout=600) as r:
    for line in r:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[5:])
        if first is None and ev.get("choices"):
            first = time.monotonic() - t0
        usage = ev.get("usage") or usage
tokens = usage["prompt_tokens"] if usage else -1
print(f"{mode:8s} round {rnd} prompt_tokens {tokens:6d} ttft_s {first:.3f} prefill_tokens_per_s {tokens / first:.0f}")
EOF
    done
  done
  kill "$server"; wait "$server" 2> /dev/null
done
cat "$LOG"
