#!/usr/bin/env bash
# GPU machine: the W4A16 kernel's parity tests and benchmark, the GPU tests of the paths that run it (golden models,
# backend against CPU, expert slots), then `bench kernels` (W4A16) and `bench step` at batch 1/16/64 on the K3 slice.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden
T=$BUNDLE/test_cuda
ensure_slice /tmp/bg-ep16-rank &
SLICE=$!
"$T" --gtest_filter='MoeW4a16*:CudaExpertSlots*:BackendDiff*:GoldenGpu*' --gtest_also_run_disabled_tests \
  > "$OUT/w4a16-gpu-tests.txt" 2>&1; echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]|^ +[0-9]+ +(on|off)" "$OUT/w4a16-gpu-tests.txt"
wait $SLICE
"$BG" bench kernels --device cuda --kernels moe_decode_w4a16 --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
grep moe_decode "$OUT/kernels.txt"
"$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches 1,16,64 --contexts 4096 --json "$OUT/step.json" \
  > "$OUT/step.txt" 2>&1
grep -A5 "^step" "$OUT/step.txt"
