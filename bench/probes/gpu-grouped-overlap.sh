#!/usr/bin/env bash
# Probe, not kept (bench/RESULTS.md, 2026-12-06): the dequantize-once prefill path with an overlapped schedule, from
# bench/probes/grouped_overlap.patch (apply it to the commit that added it, rebuild, bundle). Its parity tests
# (MoeGroupedParity.*: the overlapped runs give the serial run's bits), the kernel cases with each schedule
# (BG_MOE_GROUPED_OVERLAP x BG_MOE_GROUPED_LANES) beside the W4A16 prefill kernel, and the slice's prefill with the
# old and the new schedule. Run from the repo root with the bundle carried:
#   PARTS="parity bench prefill" bench/probes/gpu-grouped-overlap.sh [BUNDLE]
# SCHEDULES (default "0:1 1:1 1:2 1:4 0:2", overlap:lanes) picks the bench's schedules, PREFILL_TOKENS the prompts.
# Output: $OUT/grouped-overlap.txt (the summary) and logs beside it.
set -u
PARTS=${PARTS:-parity bench prefill}
want() { [[ " $PARTS " == *" $1 "* ]]; }
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR="$BUNDLE/golden"
S=$OUT/grouped-overlap.txt
: > "$S"
if want parity; then
  timeout 300 "$BUNDLE/test_cuda" --gtest_filter='MoeGroupedParity.*' > "$OUT/grouped-parity.log" 2>&1
  gtest_summary "MoeGroupedParity.*" "$OUT/grouped-parity.log" $?
fi
if want bench; then
  first=1
  for sched in ${SCHEDULES:-0:1 1:1 1:2 1:4 0:2}; do
    kernels=moe_prefill_grouped_per_expert
    [[ $first == 1 ]] && kernels=moe_prefill_grouped_per_expert,moe_prefill_w4a16,moe_prefill_grouped_dequant
    first=0
    BG_MOE_GROUPED_OVERLAP=${sched%%:*} BG_MOE_GROUPED_LANES=${sched##*:} timeout 200 "$BG" bench kernels \
      --device cuda --kernels "$kernels" --json "$OUT/grouped-${sched/:/-}.json" > "$OUT/grouped-${sched/:/-}.log" 2>&1
    echo "schedule overlap:lanes $sched rc=$?" >> "$S"
    grep -E "bench kernel|grouped_gemm" "$OUT/grouped-${sched/:/-}.log" | sed 's/^.*\] //' >> "$S"
  done
fi
if want prefill; then
  ensure_slice /tmp/bg-ep16-rank
  for sched in 0:1 1:2; do
    BG_MOE_GROUPED_OVERLAP=${sched%%:*} BG_MOE_GROUPED_LANES=${sched##*:} timeout 200 "$BG" bench prefill \
      --device cuda --model /tmp/bg-ep16-rank --prefill-tokens "${PREFILL_TOKENS:-8192,65536}" --prefill-chunk 8192 \
      --json "$OUT/prefill-${sched/:/-}.json" > "$OUT/prefill-${sched/:/-}.log" 2>&1
    echo "bench prefill, overlap:lanes $sched rc=$?" >> "$S"
    grep -E "tokens/s|chunk ms|error" "$OUT/prefill-${sched/:/-}.log" | sed 's/^.*\] //' | tail -8 >> "$S"
  done
fi
cat "$S"
