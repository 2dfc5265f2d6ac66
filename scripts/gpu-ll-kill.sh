#!/usr/bin/env bash
# kill -9 of one rank of a CUDA rank set with the ll exchange, while a request is in flight (run on the GPU machine
# from a carried bundle): the request must end with a 503 within seconds (the peers' flag waits stop through the
# watchdog's abort word, not the rank timeout), /ready must name the rank, the old set's processes must all be gone,
# and the set must come back and answer. Prints one line per check; logs go to $OUT (or ./gpu-out).
#   scripts/gpu-ll-kill.sh BUNDLE
set -u
B=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
PORT=${BG_PORT:-8410}
mkdir -p "$OUT"
SP=/opt/torch/.venv/lib/python3.12/site-packages
export LD_LIBRARY_PATH="$B/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
model=$(mktemp -d)/k3-tiny
"$B/batchgen" make-random --arch kimi_k3 --preset tiny --seed 1 --out "$model" 2> "$OUT/ll-kill-make.log"
"$B/batchgen" serve "$model" --device "${BG_DEVICE:-cuda}" --port "$PORT" --served-model-name k3 --dp 2 --ep 2 \
  --k3-moe-exchange "${BG_LL_EXCHANGE:-ll}" > "$OUT/ll-kill-serve.log" 2>&1 &
server=$!
ready() { curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/ready"; }
for _ in $(seq 1 240); do [[ $(ready) == 200 ]] && break; sleep 0.5; done
echo "ready before: $(ready)"
url="http://127.0.0.1:$PORT/v1/completions"
curl -s -o "$OUT/ll-kill-ok.json" -w 'a request before: %{http_code}\n' "$url" -H 'Content-Type: application/json' \
  -d '{"model":"k3","prompt":"hello","max_tokens":8,"temperature":0}'
old=$(grep -oE 'started rank [0-9]+ \(pid [0-9]+\)' "$OUT/ll-kill-serve.log" | grep -oE '[0-9]+\)$' | tr -d ')')
victim=$(grep -oE 'started rank 1 \(pid [0-9]+\)' "$OUT/ll-kill-serve.log" | tail -1 | grep -oE '[0-9]+\)$' | tr -d ')')
t0=$(date +%s.%N)
curl -s -o "$OUT/ll-kill-inflight.json" -w '%{http_code}' "$url" -H 'Content-Type: application/json' \
  -d '{"model":"k3","prompt":"tell me a long story","max_tokens":2000,"temperature":0,"ignore_eos":true}' \
  > "$OUT/ll-kill-inflight.code" &
client=$!
sleep 1
kill -9 "$victim"
wait "$client"
t1=$(date +%s.%N)
echo "in-flight request after kill -9 of rank 1 (pid $victim): HTTP $(cat "$OUT/ll-kill-inflight.code") after $(python3 -c "print(f'{$t1 - $t0 - 1:.2f}')") s"
echo "ready after: $(ready) $(curl -s "http://127.0.0.1:$PORT/ready" | head -c 200)"
sleep 5
alive=0
for p in $old; do kill -0 "$p" 2> /dev/null && alive=$((alive + 1)); done
echo "old set's processes still alive 5 s later: $alive of $(echo "$old" | wc -w)"
t2=$(date +%s)
for _ in $(seq 1 240); do [[ $(ready) == 200 ]] && break; sleep 0.5; done
echo "ready again: $(ready) after $(( $(date +%s) - t2 + 5 )) s"
curl -s -o "$OUT/ll-kill-after.json" -w 'a request after the restart: %{http_code}\n' "$url" \
  -H 'Content-Type: application/json' -d '{"model":"k3","prompt":"hello","max_tokens":8,"temperature":0}'
cmp -s <(sed -E 's/"(id|created)":[^,]*,//g' "$OUT/ll-kill-ok.json") \
  <(sed -E 's/"(id|created)":[^,]*,//g' "$OUT/ll-kill-after.json") && echo "same answer as before the kill" ||
  echo "answer differs from before the kill"
kill "$server"; wait "$server"
echo "serve exit: $?"
grep -E "error|abort|gone|failed" "$OUT/ll-kill-serve.log" | head -8
