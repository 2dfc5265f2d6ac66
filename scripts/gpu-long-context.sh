#!/usr/bin/env bash
# Issue 10's long-context check on the GPU machine, from a carried bundle (scripts/gpu-bundle.sh):
#  1. the K3 ep16-rank slice (real dims) prefills a 262,144-token prompt and decodes after it: time, tokens/s, the
#     device memory at its peak, the greedy continuation (`bench prefill --decode-tokens`);
#  2. a reduced-width K3 (`make-random --preset tiny` patched to 4 layers K K K M, one MLA head, 270,336 positions:
#     the same chunked KDA, paged MLA prefill passes and decode code on CUDA; small enough for the fp32 CPU
#     reference to finish) runs the same 262,144-token prompt on CUDA and on the CPU; the greedy continuations are
#     compared id by id, with each step's top-1 margin;
#  3. the slice serves a prompt of that length while /metrics is polled for the longest sequence's positions and
#     GPU bytes.
#   scripts/gpu-long-context.sh [BUNDLE] [PROMPT_TOKENS]     (default .gpu, 262144)
# Output: $OUT/long-context.txt (the summary) and the logs / JSON beside it. The slice is written once into
# $BG_BENCH_MODEL (default /tmp/bg-ep16-rank). BG_LONG_SKIP_SLICE=1 runs only step 2; BG_LONG_ONLY_SERVE=1 only step 3.
set -u
BUNDLE=${1:-.gpu}
N=${2:-262144}
DECODE=${BG_LONG_DECODE:-8}
OUT=${OUT:-$PWD/gpu-out}
MODEL=${BG_BENCH_MODEL:-/tmp/bg-ep16-rank}
REDUCED=${BG_LONG_REDUCED:-/tmp/bg-k3-long}
source "$(dirname "$0")/gpu-bundle-env.sh"
SUMMARY="$OUT/long-context.txt"
: > "$SUMMARY"
prefill() {  # prefill NAME DEVICE MODEL CHUNK: bench prefill of the N-token prompt + DECODE greedy tokens
  local name=$1 device=$2 model=$3 chunk=$4 t0=$SECONDS
  "$BG" bench prefill --device "$device" --model "$model" --prefill-tokens "$N" --prefill-chunk "$chunk" \
    --decode-tokens "$DECODE" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s" >> "$SUMMARY"
  sed -n '/^prefill /,$p' "$OUT/$name.log" >> "$SUMMARY"
}
ONLY_SERVE=${BG_LONG_ONLY_SERVE:-0}
if [[ "${BG_LONG_SKIP_SLICE:-0}" != 1 ]]; then ensure_slice "$MODEL"; fi
if [[ "${BG_LONG_SKIP_SLICE:-0}" != 1 && $ONLY_SERVE != 1 ]]; then prefill slice-cuda cuda "$MODEL" 8192; fi
if [[ $ONLY_SERVE != 1 ]]; then
PATCH='{"text_config":{"num_hidden_layers":4,"num_attention_heads":1,"num_key_value_heads":1,
  "max_position_embeddings":270336,"linear_attn_config":{"full_attn_layers":[4],"kda_layers":[1,2,3]}}}'
"$BG" make-random --arch kimi_k3 --preset tiny --out "$REDUCED" --force --config-patch "$PATCH" \
  2> "$OUT/make-random-reduced.log"
prefill reduced-cuda cuda "$REDUCED" 8192 &
cuda_job=$!
prefill reduced-cpu cpu "$REDUCED" 8192
wait "$cuda_job"
python3 - "$OUT/reduced-cuda.json" "$OUT/reduced-cpu.json" >> "$SUMMARY" <<'EOF'
import json, sys
cuda, cpu = (json.load(open(p))["prefill"][0] for p in sys.argv[1:3])
a, b = cuda["decoded_ids"], cpu["decoded_ids"]
same = sum(1 for x, y in zip(a, b) if x == y)
first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
print(f"reduced model, {cuda['prompt_tokens']}-token prompt: cuda {a}")
print(f"reduced model, {cpu['prompt_tokens']}-token prompt: cpu  {b}")
print(f"cpu margins {[round(m, 3) for m in cpu['decode_margins']]}")
print(f"equal ids: {same} of {len(b)}" + ("" if first_diff is None else f", first difference at step {first_diff}"))
EOF
fi
if [[ "${BG_LONG_SKIP_SLICE:-0}" != 1 ]]; then
  # 3. The same length served: /metrics reports the sequence's positions and GPU bytes while it runs.
  PORT=${BG_PORT:-8440}
  "$BG" serve "$MODEL" --device cuda --port "$PORT" --served-model-name k3 --max-num-seqs 4 \
    --max-model-len $((N + 256)) > "$OUT/long-serve.log" 2>&1 &
  server=$!
  wait_ready "$PORT" "$server"
  python3 - "$PORT" "$N" >> "$SUMMARY" <<'EOF'
import json, sys, threading, time, urllib.request
port, n = sys.argv[1], int(sys.argv[2])
seen = {"tokens": 0, "bytes": 0}
done = threading.Event()
def poll():
    while not done.is_set():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            for line in text.splitlines():
                for key, name in (("tokens", "batchgen_longest_sequence_tokens"),
                                  ("bytes", "batchgen_longest_sequence_gpu_bytes")):
                    if line.startswith(name + "{"):
                        seen[key] = max(seen[key], int(float(line.split()[-1])))
        except Exception:  # noqa: BLE001 - a missed poll is not a finding
            pass
        time.sleep(0.25)
t = threading.Thread(target=poll)
t.start()
prompt = [(i * 7919 + 13) % 150000 + 100 for i in range(n)]
body = json.dumps({"model": "k3", "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
t0 = time.monotonic()
try:
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    result = f"ok: {out['usage']['prompt_tokens']} prompt tokens, {out['usage']['completion_tokens']} generated"
except Exception as e:  # noqa: BLE001 - reported
    result = f"FAILED: {e}"
elapsed = time.monotonic() - t0
time.sleep(0.6)
done.set()
t.join()
print(f"served {n}-token prompt: {result} in {elapsed:.2f} s; /metrics saw the longest sequence at "
      f"{seen['tokens']} positions, {seen['bytes'] / 1e6:.1f} MB on the GPU")
EOF
  kill "$server" 2> /dev/null; wait "$server" 2> /dev/null
fi
cat "$SUMMARY"
