#!/usr/bin/env bash
# Fused linear groups on the H200 (issue 9, docs/PERF.md "Linear groups"): parity of the groups, the split and the
# models on the GPU; the linear kernel cases; the decode step of the ep16-rank slice with fusion on and off
# (BG_LINEAR_GROUPS). Logs and JSON reports in $OUT.
#   OUT=/tmp/lg scripts/gpu-linear-groups.sh .gpu
set -u
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR="$BUNDLE/golden"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
FILTER='LinearGroupCuda.*:SplitColumnsCuda.*:LinearCudaParity.*:Cases/GoldenGpu.*:Models/StepGpu.*:Archs/*'
timeout 300 "$BUNDLE/test_cuda" --gtest_filter="$FILTER:BackendDiff.*" > "$OUT/parity.log" 2>&1
echo "parity rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/parity.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$OUT/parity.log" | head -20
timeout 240 "$BG" bench kernels --device cuda --kernels linear --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "kernels rc=$?"
ensure_slice /tmp/bg-ep16-rank
for f in 1 0; do
  BG_LINEAR_GROUPS=$f timeout 240 "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches 1,16,64 \
    --contexts 4096,32768 --replays 3 --json "$OUT/step-groups$f.json" > "$OUT/step-groups$f.log" 2>&1
  echo "step BG_LINEAR_GROUPS=$f rc=$?"
  grep -E "bench step .* ms" "$OUT/step-groups$f.log" | tail -6
done
