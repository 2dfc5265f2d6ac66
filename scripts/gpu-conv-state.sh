#!/usr/bin/env bash
# GPU machine: the bf16 KDA conv state (2026-12-07, bench/RESULTS.md). Bundle of scripts/gpu-bundle.sh in $BUNDLE
# (default .gpu); for the before / after step timings also $BUNDLE/batchgen-old.xz (an xz-compressed batchgen of the
# commit before, fp32 conv state). PARTS (default all, in this order):
#   parity  the conv-state kernels' parity (short conv, KDA prep), the host tier with compressed offloads, the KDA
#           kernels, then the GPU goldens, step, graph, streamed-expert and backend-difference tests
#   kernels `bench kernels` kda_prep_decode and short_conv_decode / _prefill
#   step    `bench step` at batch 16 / 64 / 256, 4k: the old binary, then the new one (ROUNDS rounds, default 2)
# Every result is appended to $OUT/summary.txt as it comes, so a call cut short still returns what ran.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden
PARTS=${PARTS:-parity kernels step}
ROUNDS=${ROUNDS:-2}
script_start
if has parity; then
  timeout 200 "$T" --gtest_filter='*ShortConv*:*KdaPrep*:StateTierGpu.*:*Kda*' > "$OUT/parity-conv.txt" 2>&1
  gtest_summary parity-conv "$OUT/parity-conv.txt" $?
  at "conv parity"
  timeout 300 "$T" --gtest_filter='Cases/GoldenGpu.*:Models/StepGpu.*:Archs/*:Cases/StreamedExpertsGpu.*:BackendDiff*:GraphCapture*' \
    > "$OUT/parity-models.txt" 2>&1
  gtest_summary parity-models "$OUT/parity-models.txt" $?
  at "model tests"
fi
if has kernels; then
  "$BG" bench kernels --device cuda --json "$OUT/kernels.json" --kernels 'kda_prep_decode,short_conv' \
    > "$OUT/kernels.txt" 2>&1
  echo "kernels rc=$?" >> "$S"
  grep -E "^ *(kda_prep|short_conv)" "$OUT/kernels.txt" >> "$S"
  at kernels
fi
if has step; then
  wait "$SLICE"
  OLD=/tmp/batchgen-old
  [[ -x $OLD ]] || { xz -dc "$BUNDLE/batchgen-old.xz" > "$OLD" && chmod +x "$OLD"; }
  for r in $(seq 1 "$ROUNDS"); do
    for bin in "$OLD" "$BG"; do
      tag=$([[ $bin == "$OLD" ]] && echo old || echo new)
      timeout 150 "$bin" bench step --device cuda --model /tmp/bg-ep16-rank --batches 16,64,256 --contexts 4096 \
        --json "$OUT/step-$tag-$r.json" > /tmp/step.txt 2>&1
      echo "step $tag ($r) rc=$?" >> "$S"
      grep -E "bench step bg" /tmp/step.txt | sed 's/.*bench step //' >> "$S"
      grep -E "^bg-ep16-rank +[0-9]+ +4096" /tmp/step.txt >> "$S"
    done
  done
  at step
fi
cat "$S"
