#!/usr/bin/env bash
# GPU checks of the decode step's small ops and graphs (bench/RESULTS.md, the 2026-12-05 entries): the parity tests of
# the router (both top-k algorithms), the KDA recurrent step (column split bit-identical, occupancy), short conv and
# KDA prep, the MLA cache write, the graph tests (LongerContextsReplayTheSameGraph: block tables 16k tokens wide,
# padding rows), the goldens and engine-state tests; then the router and KDA recurrent kernels with each choice, the
# slice's decode step (with and without the padding-row skip), and the served --deterministic check. Run from the repo
# root with the bundle carried:
#   scripts/gpu-small-ops-check.sh [BUNDLE]
# Output: $OUT/small-ops.txt (the summary) and logs beside it. PARTS (default "parity kernels step serve"; "prep"
# checks the fused prefill conv + L2 norm; "mix" the AttnRes cluster kernel and the 16-byte KDA prep conv, each beside
# its former kernel, "mixstep" the slice's decode step with both) picks
# what runs, so that the parts can go in separate calls of the device's 10-minute limit; STEP_BATCHES and STEP_CONTEXTS
# narrow the step part.
set -u
PARTS=${PARTS:-parity kernels step serve}
want() { [[ " $PARTS " == *" $1 "* ]]; }
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
source "$(dirname "$0")/gpu-bundle-env.sh"
export BG_GOLDEN_DIR="$BUNDLE/golden"
S=$OUT/small-ops.txt
: > "$S"
if want parity; then
timeout 300 "$BUNDLE/test_cuda" --gtest_filter='RouterCudaParity.*:MoeCudaParity.*:KdaCuda.*:ShortConvParity.*:KdaPrep*:MlaCuda.Cache*:Models/StepGpu.*:Cases/GoldenGpu.*:Archs/*:MlaDecode*:GraphCapture*:Cases/StreamedExpertsGpu.*' \
  > "$OUT/parity.log" 2>&1
echo "parity rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/parity.log" | tr '\n' ' ')" >> "$S"
grep -E '^\[  FAILED' "$OUT/parity.log" | head -30 >> "$S"
fi
# The prefill steps' q / k conv with the L2 norm in one launch (BG_KDA_PREP_PREFILL_FUSED=1, off by default until
# this passes): the goldens, step tests and Archs with it, and its bench case beside the conv alone.
if want prep; then
  BG_KDA_PREP_PREFILL_FUSED=1 timeout 300 "$BUNDLE/test_cuda" \
    --gtest_filter='ShortConvParity.*:Models/StepGpu.*:Cases/GoldenGpu.*:Archs/*' > "$OUT/prep.log" 2>&1
  rc=$?
  echo "prep (BG_KDA_PREP_PREFILL_FUSED=1) rc=$rc: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/prep.log" | tr '\n' ' ')" \
    >> "$S"
  grep -E '^\[  FAILED' "$OUT/prep.log" | head -30 >> "$S"
  timeout 120 "$BG" bench kernels --device cuda --kernels short_conv > "$OUT/prep-bench.log" 2>&1
  grep -E "bench kernel short_conv" "$OUT/prep-bench.log" | sed 's/^.*\] //' >> "$S"
fi
if want mix; then
  timeout 300 "$BUNDLE/test_cuda" --gtest_filter='AttnResParity.*:KdaPrep*' > "$OUT/mix-parity.log" 2>&1
  echo "mix parity rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/mix-parity.log" | tr '\n' ' ')" >> "$S"
  grep -E '^\[  FAILED' "$OUT/mix-parity.log" | head -30 >> "$S"
  # The engine-state tests (offload and restore bit for bit without --deterministic) with each AttnRes kernel: does
  # that comparison hold by construction, or by the particular bits of one kernel's summation order?
  for k in cluster block scalar; do
    BG_ATTN_RES=$k timeout 200 "$BUNDLE/test_cuda" --gtest_filter='Archs/EngineStateGpu.*' \
      > "$OUT/mix-engine-state-$k.log" 2>&1
    echo "engine state, BG_ATTN_RES=$k rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/mix-engine-state-$k.log" \
      | tr '\n' ' ')" >> "$S"
    grep -E '^\[  FAILED' "$OUT/mix-engine-state-$k.log" | head -5 >> "$S"
  done
  timeout 120 "$BG" bench kernels --device cuda --kernels attn_res,kda_prep,rmsnorm > "$OUT/mix-kernels.log" 2>&1
  echo "mix kernels rc=$?" >> "$S"
  grep -E "bench kernel" "$OUT/mix-kernels.log" | sed 's/^.*\] //' >> "$S"
  BG_KDA_PREP_W4X128=0 timeout 120 "$BG" bench kernels --device cuda --kernels kda_prep \
    > "$OUT/mix-kernels-old.log" 2>&1
  echo "kda_prep, BG_KDA_PREP_W4X128=0: rc=$?" >> "$S"
  grep -E "bench kernel" "$OUT/mix-kernels-old.log" | sed 's/^.*\] //' >> "$S"
fi
if want mixstep; then
  ensure_slice /tmp/bg-ep16-rank
  for v in new old; do
    env_set=""
    [[ $v == old ]] && env_set="BG_ATTN_RES=block BG_KDA_PREP_W4X128=0"
    env $env_set timeout 200 "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches 1,16,64 \
      --contexts 4096 --replays 5 --json "$OUT/mix-step-$v.json" > "$OUT/mix-step-$v.log" 2>&1
    echo "step, $v kernels ($env_set) rc=$?" >> "$S"
    grep -E "bench step" "$OUT/mix-step-$v.log" | sed 's/^.*\] //' >> "$S"
  done
fi
if want kernels; then
for sp in 1 auto; do
  BG_KDA_RECURRENT_SPLIT=$sp timeout 120 "$BG" bench kernels --device cuda --kernels kda_recurrent \
    > "$OUT/kda-split-$sp.log" 2>&1
  echo "kda_recurrent, BG_KDA_RECURRENT_SPLIT=$sp: rc=$?" >> "$S"
  grep -E "bench kernel kda" "$OUT/kda-split-$sp.log" | sed 's/^.*\] //' >> "$S"
done
timeout 120 "$BG" bench kernels --device cuda --kernels router_topk > "$OUT/router.log" 2>&1
echo "router rc=$?" >> "$S"
grep -E "bench kernel" "$OUT/router.log" | sed 's/^.*\] //' >> "$S"
fi
if want step; then
ensure_slice /tmp/bg-ep16-rank
# 20 and 57 run padded graphs (24 and 64): the padding rows' skip shows there.
timeout 240 "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches "${STEP_BATCHES:-1,16,20,57,64}" \
  --contexts "${STEP_CONTEXTS:-4096,32768}" --replays 5 --json "$OUT/step.json" > "$OUT/step.log" 2>&1
echo "step rc=$?" >> "$S"
grep -E "captured graph|bench step|bench host" "$OUT/step.log" | sed 's/^.*\] //' >> "$S"
BG_SKIP_PADDING_ROWS=0 timeout 120 "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches 20,57 \
  --contexts "${STEP_CONTEXTS:-4096,32768}" --replays 5 --json "$OUT/step-padding-run.json" > "$OUT/step-padding-run.log" 2>&1
echo "step, padding rows run (BG_SKIP_PADDING_ROWS=0) rc=$?" >> "$S"
grep -E "bench step" "$OUT/step-padding-run.log" | sed 's/^.*\] //' >> "$S"
fi
if want serve; then
OUT=$OUT/serve BG_SERVE_ARGS=--deterministic timeout 240 bash "$(dirname "$0")/gpu-serve-check.sh" "$BUNDLE" \
  > "$OUT/serve-check.log" 2>&1
echo "serve check (--deterministic) rc=$?" >> "$S"
tail -6 "$OUT/serve-check.log" >> "$S"
fi
cat "$S"
