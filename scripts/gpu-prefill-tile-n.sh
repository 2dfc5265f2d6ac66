#!/usr/bin/env bash
# GPU machine: the W4A16 prefill kernel's tiles on the fewest multiple of 16 rows (2026-12-07, docs/MOE_PREFILL.md)
# against the binary before it. Bundle of scripts/gpu-bundle.sh in $BUNDLE (default .gpu), the old batchgen xz'd in
# $BUNDLE/old/batchgen.xz. PARTS (default all, in this order):
#   parity  the kernel's parity (every N from 1 to 300 rows per expert), the decode kernel's and the dispatch's, then
#           the goldens, step tests, Archs and streamed experts with BG_MOE_PREFILL=w4a16
#   kernels `bench kernels` moe_crossover_prefill_kernel (18..292 rows per expert) and moe_prefill_w4a16, old / new
#           interleaved (ROUNDS rounds, default 2)
#   step    `bench step` at batch 128 / 256, 4k (37 / 73 rows per expert: the prefill kernel inside the graph), old /
#           new interleaved
#   full    the whole test_cuda (up to FULL_S seconds, default 300)
# Every result is appended to $OUT/summary.txt as it comes, so a call cut short still returns what ran.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden BG_BATCHGEN=$PWD/$BUNDLE/batchgen
PARTS=${PARTS:-parity kernels step full}
ROUNDS=${ROUNDS:-2}
script_start
OLD=$BUNDLE/old/batchgen
if [[ ! -x $OLD ]]; then xz -dc "$BUNDLE/old/batchgen.xz" > "$OLD" && chmod +x "$OLD"; fi
echo "old: $("$OLD" --version | head -1); new: $("$BG" --version | head -1)" >> "$S"
if has parity; then
  timeout 240 "$T" --gtest_filter='MoeW4a16Prefill.*:MoeW4a16Parity.*:MoeCudaParity.*' > "$OUT/parity.txt" 2>&1
  gtest_summary parity "$OUT/parity.txt" $?
  BG_MOE_PREFILL=w4a16 timeout 200 "$T" \
    --gtest_filter='Cases/GoldenGpu.*:Models/StepGpu.*:Archs/*:Cases/StreamedExpertsGpu.*:GraphCapture*' \
    > "$OUT/models.txt" 2>&1
  gtest_summary "models, BG_MOE_PREFILL=w4a16" "$OUT/models.txt" $?
  at parity
fi
if has kernels; then
  for r in $(seq 1 "$ROUNDS"); do
    for v in old new; do
      bin=$BG; [[ $v == old ]] && bin=$OLD
      timeout 150 "$bin" bench kernels --device cuda --kernels 'moe_crossover_prefill_kernel,moe_prefill_w4a16' \
        --json "$OUT/kernels-$v-$r.json" > "$OUT/kernels-$v-$r.txt" 2>&1
      echo "kernels $v ($r) rc=$?" >> "$S"
      grep -E "^(moe_crossover_prefill|moe_prefill_w4a16)" "$OUT/kernels-$v-$r.txt" >> "$S"
    done
  done
  at kernels
fi
if has step; then
  wait "$SLICE"
  for r in $(seq 1 "$ROUNDS"); do
    for v in old new; do
      bin=$BG; [[ $v == old ]] && bin=$OLD
      timeout 150 "$bin" bench step --device cuda --model /tmp/bg-ep16-rank --batches 128,256 --contexts 4096 \
        --json "$OUT/step-$v-$r.json" > "$OUT/step-$v-$r.txt" 2>&1
      echo "step $v ($r) rc=$?" >> "$S"
      grep -E "^bg-ep16-rank +[0-9]+ +4096" "$OUT/step-$v-$r.txt" >> "$S"
    done
  done
  at step
fi
if has full; then
  timeout "${FULL_S:-300}" "$T" --gtest_brief=1 > "$OUT/test_cuda.txt" 2>&1
  gtest_summary full "$OUT/test_cuda.txt" $?
  at full
fi
cat "$S"
