#!/usr/bin/env bash
# MLA decode on the H200 (docs/MLA_DECODE.md): parity of both heads-as-N policies (the heads-as-M kernel, the default:
# scripts/gpu-mla-heads-m.sh) and the GPU goldens, the micro-benchmark,
# Nsight Compute on one attention launch (BG_MLA_DECODE_PROFILE shape, default 64,4096: details page and per-opcode
# instruction counts), then the decode step of the ep16-rank slice. Logs and reports in $OUT.
#   OUT=/tmp/md scripts/gpu-mla-decode-profile.sh .gpu
set -u
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR="$BUNDLE/golden"
T="$BUNDLE/test_cuda"
for f in 'Wgmma/MlaDecode.*' 'MmaSync/MlaDecode.*:Cases/GoldenGpu.*:Models/StepGpu.*'; do
  timeout 300 "$T" --gtest_filter="$f" > "$OUT/parity.log" 2>&1
  echo "parity $f rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/parity.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$OUT/parity.log" | head -10
done
timeout 200 "$T" --gtest_also_run_disabled_tests --gtest_filter='MlaDecodeBench.DISABLED_K3Shapes' \
  > "$OUT/bench.txt" 2>&1
grep -E "^mma|^wgmma|^mmasync" "$OUT/bench.txt"
BG_MLA_DECODE=wgmma timeout 180 ncu --clock-control none --kernel-name regex:attention_kernel --launch-skip 2 --launch-count 1 --set full \
  -o "$OUT/mla" "$T" --gtest_also_run_disabled_tests --gtest_filter='MlaDecodeBench.DISABLED_ProfileOne' \
  > "$OUT/ncu.log" 2>&1
ncu --import "$OUT/mla.ncu-rep" --page details > "$OUT/details.txt" 2>&1
ncu --import "$OUT/mla.ncu-rep" --page source --csv --print-source sass 2> /dev/null | xz > "$OUT/sass.csv.xz"
grep -E "Duration|Executed Instructions  |Issue Slots Busy|DRAM Throughput" "$OUT/details.txt"
ensure_slice /tmp/bg-ep16-rank
timeout 240 "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches 1,16,64 --contexts 4096,32768 \
  --replays 3 --json "$OUT/step.json" > "$OUT/step.log" 2>&1
echo "step rc=$?"
grep -E "bench step .* ms" "$OUT/step.log" | sed 's/.*bench step/bench step/'
