#!/usr/bin/env bash
# GPU machine: the fused linear groups' parts read in place as strided views (2026-12-07, docs/PERF.md "Linear
# groups"). Bundle of scripts/gpu-bundle.sh in $BUNDLE (default .gpu). PARTS (default all, in this order):
#   parity  the strided readers' parity (linear, gated RMSNorm, SiTU, the W4A16 decode kernel, KDA prep, the groups),
#           then the GPU goldens, step, graph, streamed-expert and backend-difference tests, both with the views (the
#           default) and with BG_LINEAR_GROUP_VIEWS=0
#   step    `bench step` at batch 16 / 64, 4k: BG_LINEAR_GROUP_VIEWS=0, then the default (ROUNDS rounds, default 2)
#   full    the whole test_cuda (what time is left, up to FULL_S seconds, default 300)
# Every result is appended to $OUT/summary.txt as it comes, so a call cut short still returns what ran.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden BG_BATCHGEN=$PWD/$BUNDLE/batchgen
PARTS=${PARTS:-parity step full}
ROUNDS=${ROUNDS:-2}
script_start
MODELS='Cases/GoldenGpu.*:Models/StepGpu.*:Archs/*:Cases/StreamedExpertsGpu.*:BackendDiff*:GraphCapture*'
if has parity; then
  timeout 200 "$T" --gtest_filter='LinearGroupCuda.*:LinearCudaParity.*:GatedRmsNormParity.*:ElementwiseParity.*:'\
'MoeW4a16Parity.*:*KdaPrep*' > "$OUT/parity-ops.txt" 2>&1
  gtest_summary parity-ops "$OUT/parity-ops.txt" $?
  at "op parity"
  timeout 200 "$T" --gtest_filter="$MODELS" > "$OUT/parity-models.txt" 2>&1
  gtest_summary parity-models "$OUT/parity-models.txt" $?
  BG_LINEAR_GROUP_VIEWS=0 timeout 200 "$T" --gtest_filter="$MODELS" > "$OUT/parity-models-split.txt" 2>&1
  gtest_summary parity-models-split "$OUT/parity-models-split.txt" $?
  at "model tests"
fi
if has step; then
  wait "$SLICE"
  for r in $(seq 1 "$ROUNDS"); do
    for v in 0 1; do
      BG_LINEAR_GROUP_VIEWS=$v timeout 120 "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches 16,64 \
        --contexts 4096 --json "$OUT/step-views$v-$r.json" > /tmp/step.txt 2>&1
      echo "step views=$v ($r) rc=$?" >> "$S"
      grep -E "^bg-ep16-rank +[0-9]+ +4096" /tmp/step.txt >> "$S"
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
