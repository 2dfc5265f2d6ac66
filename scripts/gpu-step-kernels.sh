#!/usr/bin/env bash
# GPU machine: every kernel of the slice's decode step timed by Nsight Compute (one metric, gpu__time_duration), so
# the step's time can be split kernel by kernel (the op trace times ops, and sampling is one op of five kernels).
#   BATCH (default 64), CONTEXT (default 4096), COUNT (kernels profiled, default 1300: about 8 steps at B = 64 after
#   the model's load; the bench's ceiling kernels are filtered out by name)
#   TESTS  a gtest filter run first (optional)
# Writes $OUT/step-kernels.csv (ncu's CSV) and $OUT/summary.txt.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden
S=$OUT/summary.txt
ensure_slice /tmp/bg-ep16-rank & SLICE=$!
if [[ -n "${TESTS:-}" ]]; then
  timeout 300 "$BUNDLE/test_cuda" --gtest_filter="$TESTS" > "$OUT/tests.txt" 2>&1
  gtest_summary tests "$OUT/tests.txt" $?
fi
wait $SLICE
timeout 400 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count "${COUNT:-1300}" \
  --kernel-name 'regex:^(?!.*(empty_kernel|read_kernel|copy_kernel|fill_|cutlass)).*' \
  "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches "${BATCH:-64}" --contexts "${CONTEXT:-4096}" \
  > "$OUT/step-kernels.csv" 2> "$OUT/step-kernels.err"
echo "ncu rc=$?" >> "$S"
tail -5 "$OUT/step-kernels.err" >> "$S"
