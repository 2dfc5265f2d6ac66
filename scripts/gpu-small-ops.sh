#!/usr/bin/env bash
# Small ops of the decode step on the H200 (issue 9, docs/PERF.md "Small ops"): parity of the fused kernels and the
# models on the GPU, then the decode step of the ep16-rank slice with its per-op breakdown timed inside a graph
# (`small us/layer`), with the fused KDA preparation on and off (BG_KDA_PREP_FUSED). Logs and JSON in $OUT.
#   OUT=/tmp/so scripts/gpu-small-ops.sh .gpu
set -u
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR="$BUNDLE/golden"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
FILTER=${BG_SMALL_OPS_FILTER:-'KdaPrepParity.*:KdaGateParity.*:ShortConvParity.*:RmsNormParity.*:Cases/GoldenGpu.*'}
FILTER="$FILTER:Models/StepGpu.*:BackendDiff.*:Archs/*"
timeout 300 "$BUNDLE/test_cuda" --gtest_filter="$FILTER" > "$OUT/parity.log" 2>&1
echo "parity rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/parity.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$OUT/parity.log" | head -20
ensure_slice /tmp/bg-ep16-rank
for f in ${BG_SMALL_OPS_SWITCH:-1 0}; do
  BG_KDA_PREP_FUSED=$f timeout 240 "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches 1,16,64 \
    --contexts ${BG_SMALL_OPS_CONTEXTS:-4096} --replays 5 --json "$OUT/step-prep$f.json" > "$OUT/step-prep$f.log" 2>&1
  echo "step BG_KDA_PREP_FUSED=$f rc=$?"
  grep -A5 "small us/layer" "$OUT/step-prep$f.log" | head -6
done
