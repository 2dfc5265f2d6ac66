#!/usr/bin/env bash
# Streamed experts with and without the next layer's prefetch on the H200: the streamed-expert parity tests (bit for
# bit against the resident model, prefetch on), then `bench step` on the ep16-rank slice at --resident-experts 0.5,
# batches 1/16/64 at 4k context, with BG_EXPERT_PREFETCH=0 and with the default (prefetch on).
#   scripts/gpu-streamed-prefetch.sh [BUNDLE]
# Output: $OUT/streamed-prefetch.txt (the summary), the JSON and logs beside it.
set -u
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
MODEL=${BG_BENCH_MODEL:-/tmp/bg-ep16-rank}
source "$(dirname "$0")/gpu-bundle-env.sh"
export BG_GOLDEN_DIR="$BUNDLE/golden"
SUMMARY="$OUT/streamed-prefetch.txt"
: > "$SUMMARY"
"$BUNDLE/test_cuda" --gtest_filter='*Streamed*' > "$OUT/parity.log" 2>&1
echo "parity rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/parity.log" | tr '\n' ' ')" >> "$SUMMARY"
grep -E '^\[  FAILED' "$OUT/parity.log" >> "$SUMMARY"
ensure_slice "$MODEL"
for mode in off on; do
  t0=$SECONDS
  if [[ $mode == off ]]; then export BG_EXPERT_PREFETCH=0; else unset BG_EXPERT_PREFETCH; fi
  "$BG" bench step --device cuda --model "$MODEL" --batches 1,16,64 --contexts 4096 --replays 5 \
    --resident-experts 0.5 --json "$OUT/step-prefetch-$mode.json" > "$OUT/step-prefetch-$mode.log" 2>&1
  echo "prefetch $mode: rc=$? $((SECONDS - t0)) s" >> "$SUMMARY"
  grep -E " 4096 |streamed experts:" "$OUT/step-prefetch-$mode.log" >> "$SUMMARY"
done
cat "$SUMMARY"
