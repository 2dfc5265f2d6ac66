#!/usr/bin/env bash
# Does `serve` with its memory defaults hold up on the K3 ep16-rank slice? On the GPU machine, from a carried bundle
# (scripts/gpu-bundle.sh):
#  1. what a prefill step needs: `bench prefill` at 8192-token steps (prompts of 8192 and 65536 tokens) reports the
#     allocator's peak in use and the device's use at the peak;
#  2. `serve` with the defaults (--gpu-memory-utilization 0.9, every other byte to the KV cache, 8192-token idle
#     prefill steps, decode graphs up to 256 sequences) must get through its warm-up and answer a 8192-token and a
#     30000-token prompt and 64 concurrent short requests.
#   scripts/gpu-memory-check.sh [BUNDLE]        Output: $OUT/memory-check.txt and the logs beside it.
set -u
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
PORT=${BG_PORT:-8430}
MODEL=${BG_BENCH_MODEL:-/tmp/bg-ep16-rank}
source "$(dirname "$0")/gpu-bundle-env.sh"
SUMMARY="$OUT/memory-check.txt"
: > "$SUMMARY"
ensure_slice "$MODEL"
"$BG" bench prefill --device cuda --model "$MODEL" --prefill-tokens 8192,65536 --prefill-chunk 8192 \
  --json "$OUT/memory-prefill.json" > "$OUT/memory-prefill.log" 2>&1
echo "bench prefill rc=$?" >> "$SUMMARY"
python3 - "$OUT/memory-prefill.json" >> "$SUMMARY" <<'EOF'
import json, sys
for p in json.load(open(sys.argv[1]))["prefill"]:
    print(f"prompt {p['prompt_tokens']}: allocator in use at most {p['peak_in_use_bytes'] / 1e9:.2f} GB, held "
          f"{p['peak_pool_bytes'] / 1e9:.2f} GB, device at the peak {p['peak_device_bytes'] / 1e9:.2f} GB of "
          f"{p['device_total_bytes'] / 1e9:.2f}")
EOF
t0=$SECONDS
"$BG" serve "$MODEL" --device cuda --port "$PORT" --served-model-name k3 > "$OUT/memory-serve.log" 2>&1 &
server=$!
ready=0
wait_ready "$PORT" "$server" && ready=1
echo "serve defaults: ready=$ready after $((SECONDS - t0)) s" >> "$SUMMARY"
grep -E "worker rank 0: |warmed up|out of memory|error" "$OUT/memory-serve.log" | head -8 >> "$SUMMARY"
if [[ $ready == 1 ]]; then
  python3 - "$PORT" >> "$SUMMARY" <<'EOF'
import json, sys, time, urllib.request, concurrent.futures as cf
port = sys.argv[1]
def complete(prompt, max_tokens):
    body = json.dumps({"model": "k3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.load(r)
        return f"ok {out['usage']['prompt_tokens']} prompt tokens, {out['usage']['completion_tokens']} generated, " \
               f"{time.monotonic() - t0:.2f} s"
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"FAILED {e}"
for n in (8192, 30000):
    print(f"{n}-token prompt: {complete([(i * 31 + n) % 150000 + 100 for i in range(n)], 4)}")
with cf.ThreadPoolExecutor(64) as ex:
    results = list(ex.map(lambda k: complete([(k * 7919 + i) % 150000 + 100 for i in range(64)], 16), range(64)))
print(f"64 concurrent: {sum(r.startswith('ok') for r in results)} of 64 ok; first failure: "
      f"{next((r for r in results if not r.startswith('ok')), 'none')}")
EOF
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^batchgen_(kv_gpu_bytes_used|kv_blocks_total|state_slots_total)" \
    >> "$SUMMARY"
fi
kill "$server" 2> /dev/null; wait "$server" 2> /dev/null
cat "$SUMMARY"
