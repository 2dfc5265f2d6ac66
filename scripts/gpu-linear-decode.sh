#!/usr/bin/env bash
# GPU machine: the dense decode GEMM (ops/linear/linear_decode_cuda.cu) against cuBLAS (BG_LINEAR_DECODE=0).
# PARTS (default "tests kernels step splits"): tests = its parity and every GPU path that runs the dense linears
# (TESTS overrides the filter); kernels = `bench kernels` of the dense linears both ways; step = `bench step` on the
# K3 slice, ROUNDS (default "a b") interleaved rounds each way at BATCHES; splits = the k-split choice swept (SPLITS)
# on the split shapes. Summary in $OUT/summary.txt.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden
PARTS=${PARTS:-tests kernels step splits}
S=$OUT/summary.txt
LOG=/tmp/linear-decode-logs; mkdir -p $LOG
if has step; then ensure_slice /tmp/bg-ep16-rank & SLICE=$!; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader >> "$S"
if has tests; then
  "$BUNDLE/test_cuda" --gtest_filter="${TESTS:-DenseDecode*:LinearCuda*:Cases/GoldenGpu.*:Models/StepGpu.*:Archs/*:GraphCapture*:BackendDiff*:Cases/StreamedExpertsGpu.*}" \
    > "$OUT/tests.txt" 2>&1
  gtest_summary tests "$OUT/tests.txt" $?
fi
K=linear_bf16_decode,linear_group_decode,lm_head_decode
if has kernels; then
  for on in 1 0; do
    BG_LINEAR_DECODE=$on "$BG" bench kernels --device cuda --kernels $K --json "$OUT/kernels-$on.json" \
      > $LOG/kernels-$on.txt 2>&1
    echo "kernels decode=$on rc=$?" >> "$S"; grep -E "^(linear|lm_head)" $LOG/kernels-$on.txt >> "$S"
  done
fi
if has step; then
  wait $SLICE
  for round in ${ROUNDS:-a b}; do
    for on in 1 0; do
      BG_LINEAR_DECODE=$on "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches ${BATCHES:-1,16,64} \
        --contexts 4096 --json "$OUT/step-$on-$round.json" > $LOG/step-$on-$round.txt 2>&1
      echo "step decode=$on round $round rc=$?" >> "$S"; grep -A5 "^step" $LOG/step-$on-$round.txt >> "$S"
    done
  done
fi
if has splits; then
  for n in ${SPLITS:-2 3 6 8}; do
    BG_LINEAR_DECODE_SPLITS=$n "$BG" bench kernels --device cuda --kernels o_proj,latent_up,shared_down,dense_down,router \
      > $LOG/splits-$n.txt 2>&1
    echo "splits=$n rc=$?" >> "$S"; grep -E "^linear" $LOG/splits-$n.txt | grep -E "T=(16|64)" >> "$S"
  done
fi
cat "$S"
