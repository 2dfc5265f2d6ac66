#!/usr/bin/env bash
# Issue 10's long-context check on the GPU machine, from a carried bundle (scripts/gpu-bundle.sh):
#  1. the K3 ep16-rank slice (real dims) prefills a 262,144-token prompt and decodes after it: time, tokens/s, the
#     device memory at its peak, the greedy continuation (`bench prefill --decode-tokens`);
#  2. a reduced-width K3 (`make-random --preset tiny` patched to 4 layers K K K M, one MLA head, 270,336 positions:
#     the same chunked KDA, paged MLA prefill passes and decode code on CUDA; small enough for the fp32 CPU
#     reference to finish) runs the same 262,144-token prompt on CUDA and on the CPU; the greedy continuations are
#     compared id by id, with each step's top-1 margin.
#   scripts/gpu-long-context.sh [BUNDLE] [PROMPT_TOKENS]     (default .gpu, 262144)
# Output: $OUT/long-context.txt (the summary) and the logs / JSON beside it. The slice is written once into
# $BG_BENCH_MODEL (default /tmp/bg-ep16-rank). BG_LONG_SKIP_SLICE=1 runs only step 2.
set -u
BUNDLE=${1:-.gpu}
N=${2:-262144}
DECODE=${BG_LONG_DECODE:-8}
OUT=${OUT:-$PWD/gpu-out}
MODEL=${BG_BENCH_MODEL:-/tmp/bg-ep16-rank}
REDUCED=${BG_LONG_REDUCED:-/tmp/bg-k3-long}
mkdir -p "$OUT"
if [[ -f $BUNDLE/bundle.tar.xz && ! -x $BUNDLE/batchgen ]]; then tar -C "$BUNDLE" -xJf "$BUNDLE/bundle.tar.xz"; fi
SP=/opt/torch/.venv/lib/python3.12/site-packages
export LD_LIBRARY_PATH="$BUNDLE/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
BG="$BUNDLE/batchgen"
SUMMARY="$OUT/long-context.txt"
: > "$SUMMARY"
prefill() {  # prefill NAME DEVICE MODEL CHUNK: bench prefill of the N-token prompt + DECODE greedy tokens
  local name=$1 device=$2 model=$3 chunk=$4 t0=$SECONDS
  "$BG" bench prefill --device "$device" --model "$model" --prefill-tokens "$N" --prefill-chunk "$chunk" \
    --decode-tokens "$DECODE" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s" >> "$SUMMARY"
  sed -n '/^prefill /,$p' "$OUT/$name.log" >> "$SUMMARY"
}
if [[ "${BG_LONG_SKIP_SLICE:-0}" != 1 ]]; then
  if [[ ! -f "$MODEL/model.safetensors.index.json" ]]; then
    "$BG" make-random --arch kimi_k3 --preset ep16-rank --out "$MODEL" --force 2> "$OUT/make-random-ep16.log"
  fi
  prefill slice-cuda cuda "$MODEL" 8192
fi
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
cat "$SUMMARY"
