#!/usr/bin/env bash
# GPU machine: the W4A16 kernel's stream-K schedule against the split choice it replaced (BG_MOE_W4A16_STREAM_K=0).
# PARTS (default "tests micro kernels step"): tests = parity of the kernel and of every GPU path that runs it;
# micro = the experiment binaries in .gpu/var (scripts/w4a16-variant-build.sh) at 16 and 32 touched experts;
# kernels = `bench kernels` moe_decode_w4a16 with and without stream-K; step = `bench step` on the K3 slice, two
# interleaved rounds of each. Summary in $OUT/summary.txt.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden
PARTS=${PARTS:-tests micro kernels step}
S=$OUT/summary.txt
T=$BUNDLE/test_cuda
LOG=/tmp/streamk-logs; mkdir -p $LOG
if has step; then ensure_slice /tmp/bg-ep16-rank & SLICE=$!; fi
if has tests; then
  "$T" --gtest_filter="$W4A16_TESTS" > "$OUT/tests.txt" 2>&1
  gtest_summary tests "$OUT/tests.txt" $?
fi
if has micro; then
  for touched in 16 32; do
    for v in $BUNDLE/var/*; do
      echo "== $(basename "$v") touched=$touched" >> "$S"
      BG_W4A16_BENCH_TOUCHED=$touched "$v" 1 4 16 18 32 2>&1 | tail -12 >> "$S"
    done
  done
fi
if has kernels; then
  for on in 1 0; do
    BG_MOE_W4A16_STREAM_K=$on "$BG" bench kernels --device cuda --kernels moe_decode_w4a16 \
      --json "$OUT/kernels-$on.json" > $LOG/kernels-$on.txt 2>&1
    echo "kernels stream-K=$on rc=$?" >> "$S"; grep moe_decode $LOG/kernels-$on.txt >> "$S"
  done
fi
if has step; then
  wait $SLICE
  for round in a b; do
    for on in 1 0; do
      BG_MOE_W4A16_STREAM_K=$on "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches ${BATCHES:-1,16,64} \
        --contexts 4096 --json "$LOG/step-$on-$round.json" > $LOG/step-$on-$round.txt 2>&1
      echo "step stream-K=$on round $round rc=$?" >> "$S"; grep -A6 "^step" $LOG/step-$on-$round.txt >> "$S"
    done
  done
  cp $LOG/step-1-b.json "$OUT/step-streamk.json"; cp $LOG/step-0-b.json "$OUT/step-split.json"
fi
cat "$S"
