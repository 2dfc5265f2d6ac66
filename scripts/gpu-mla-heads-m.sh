#!/usr/bin/env bash
# The heads-as-M MLA decode kernel on the H200 (docs/MLA_DECODE.md, "Heads as M"): its parity suite, the goldens and
# step tests with the backend on it (BG_MLA_DECODE=heads_m), the micro-benchmark of every attention kernel, the
# slice's decode step with the default kernel and with heads_m, and (PARTS with ncu) Nsight Compute on one launch.
# Run from the repo root with the bundle carried:
#   PARTS="parity bench step" scripts/gpu-mla-heads-m.sh [BUNDLE]
# Output: $OUT/heads-m.txt (the summary) and logs beside it.
set -u
PARTS=${PARTS:-parity bench step}
want() { [[ " $PARTS " == *" $1 "* ]]; }
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
source "$(dirname "$0")/gpu-bundle-env.sh"
export BG_GOLDEN_DIR="$BUNDLE/golden"
T="$BUNDLE/test_cuda"
S=$OUT/heads-m.txt
: > "$S"
if want parity; then
  timeout 240 "$T" --gtest_filter='WgmmaHeadsM/MlaDecode.*' > "$OUT/parity.log" 2>&1
  echo "parity WgmmaHeadsM rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/parity.log" | tr '\n' ' ')" >> "$S"
  grep -E '^\[  FAILED  \]|Failure|error' "$OUT/parity.log" | head -20 >> "$S"
  BG_MLA_DECODE=heads_m timeout 240 "$T" --gtest_filter='Cases/GoldenGpu.*:Models/StepGpu.*:Archs/*' \
    > "$OUT/goldens.log" 2>&1
  echo "goldens, step, Archs with BG_MLA_DECODE=heads_m rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/goldens.log" \
    | tr '\n' ' ')" >> "$S"
  grep -E '^\[  FAILED  \]' "$OUT/goldens.log" | head -20 >> "$S"
fi
if want bench; then
  timeout 200 "$T" --gtest_also_run_disabled_tests --gtest_filter='MlaDecodeBench.DISABLED_K3Shapes' \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" >> "$S"
  grep -E "^mma|^wgmma|^mmasync|fraction|policy" "$OUT/bench.log" >> "$S"
fi
if want step; then
  ensure_slice /tmp/bg-ep16-rank
  for k in wgmma heads_m; do
    BG_MLA_DECODE=$k timeout 200 "$BG" bench step --device cuda --model /tmp/bg-ep16-rank \
      --batches "${STEP_BATCHES:-1,16,64}" --contexts "${STEP_CONTEXTS:-4096,32768}" --replays 5 \
      --json "$OUT/step-$k.json" > "$OUT/step-$k.log" 2>&1
    echo "step BG_MLA_DECODE=$k rc=$?" >> "$S"
    grep -E "bench step .* ms" "$OUT/step-$k.log" | sed 's/.*bench step/bench step/' >> "$S"
  done
fi
if want ncu; then
  BG_MLA_DECODE=heads_m timeout 180 ncu --clock-control none --kernel-name regex:heads_m_kernel --launch-skip 2 \
    --launch-count 1 --set full -o "$OUT/hm" "$T" --gtest_also_run_disabled_tests \
    --gtest_filter='MlaDecodeBench.DISABLED_ProfileOne' > "$OUT/ncu.log" 2>&1
  ncu --import "$OUT/hm.ncu-rep" --page details > "$OUT/details.txt" 2>&1
  rm -f "$OUT/hm.ncu-rep"
  grep -E "Duration|Executed Instructions  |Issue Slots Busy|DRAM Throughput|Registers Per|Theoretical Occ" \
    "$OUT/details.txt" >> "$S"
fi
cat "$S"
