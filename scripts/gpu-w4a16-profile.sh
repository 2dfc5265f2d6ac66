#!/usr/bin/env bash
# GPU machine: SASS and Nsight Compute source-level profiles of the W4A16 expert kernel (MoeW4a16Bench launches).
#   ROWS_SKIPS="1:0 16:392"  rows-per-expert label : launches of moe_w4a16 kernels to skip (98 per bench config)
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
T="$BUNDLE/test_cuda"
cuobjdump -sass "$T" | awk '/Function : /{p = /moe_w4a16_kernel/} p' > "$OUT/w4a16-sass.txt" 2>&1
F='--gtest_also_run_disabled_tests --gtest_filter=MoeW4a16Bench.*'
"$T" $F > "$OUT/w4a16-bench.txt" 2>&1
for rs in ${ROWS_SKIPS:-1:0 16:392}; do
  r=${rs%%:*}; s=${rs##*:}
  ncu --clock-control none --set full --import-source yes --kernel-name regex:moe_w4a16 --launch-skip "$s" \
    --launch-count 1 -o "$OUT/w4a16-rows$r" "$T" $F > "$OUT/ncu-run-rows$r.txt" 2>&1
  ncu -i "$OUT/w4a16-rows$r.ncu-rep" --page details > "$OUT/w4a16-rows$r-details.txt" 2>&1
  ncu -i "$OUT/w4a16-rows$r.ncu-rep" --page source --csv --print-source sass > "$OUT/w4a16-rows$r-sass.csv" 2>&1
done
ls -la "$OUT"
