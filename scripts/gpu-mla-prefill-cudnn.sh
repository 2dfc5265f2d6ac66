#!/usr/bin/env bash
# MLA prefill through cuDNN's fused attention on the H200 (docs/MLA_PREFILL.md, "cuDNN"): the prefill parity tests
# (every path against the CPU reference, cuDNN's launches counted) and the GPU goldens, then the mla_prefill kernel
# cases (cuDNN default beside batchgen's wgmma / mma.sync kernels) and slice prefill at 8k / 64k with cuDNN and with
# BG_MLA_PREFILL=wgmma.
#   scripts/gpu-mla-prefill-cudnn.sh [BUNDLE]
# Output: $OUT/mla-prefill-cudnn.txt (the summary), the JSON and logs beside it.
set -u
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
MODEL=${BG_BENCH_MODEL:-/tmp/bg-ep16-rank}
source "$(dirname "$0")/gpu-bundle-env.sh"
export BG_GOLDEN_DIR="$BUNDLE/golden"
SUMMARY="$OUT/mla-prefill-cudnn.txt"
: > "$SUMMARY"
timeout 300 "$BUNDLE/test_cuda" \
  --gtest_filter='MlaPrefillCuda.*:MlaPrefillCudnn.*:Cases/GoldenGpu.*:Models/StepGpu.*:Archs/*:BackendDiff.*' \
  > "$OUT/parity.log" 2>&1
echo "parity rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/parity.log" | tr '\n' ' ')" >> "$SUMMARY"
grep -E '^\[  FAILED|on cuDNN' "$OUT/parity.log" | grep -E 'FAILED|cudnn\]' >> "$SUMMARY"
timeout 240 "$BG" bench kernels --device cuda --kernels mla_prefill --json "$OUT/kernels-mla-prefill.json" \
  > "$OUT/kernels-mla-prefill.log" 2>&1
echo "kernels rc=$?" >> "$SUMMARY"
grep -E "mla_prefill" "$OUT/kernels-mla-prefill.log" >> "$SUMMARY"
ensure_slice "$MODEL"
for mode in cudnn wgmma; do
  t0=$SECONDS
  BG_MLA_PREFILL=$mode timeout 200 "$BG" bench prefill --device cuda --model "$MODEL" --prefill-tokens 8192,65536 \
    --prefill-chunk 8192 --json "$OUT/prefill-$mode.json" > "$OUT/prefill-$mode.log" 2>&1
  echo "prefill $mode: rc=$? $((SECONDS - t0)) s" >> "$SUMMARY"
  tail -6 "$OUT/prefill-$mode.log" >> "$SUMMARY"
done
cat "$SUMMARY"
