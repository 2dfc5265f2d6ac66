#!/usr/bin/env bash
# GPU machine: the W4A16 kernel's fused combine (the down launch's weighted sum of a token's slots) measured on the
# routing the decode step has. PARTS (default "tests micro kernels step profile"): tests = parity of the kernel and of
# every GPU path that runs it; micro = the experiment binaries in .gpu/var (scripts/w4a16-variant-build.sh) on a
# random top-16 of 56 experts at TOKENS (default "1 16 64"), two rounds in opposite orders; kernels = `bench kernels`
# moe_decode_w4a16 (once per KERNEL_ENVS entry); envtests = the GPU goldens and step tests once per KERNEL_ENVS entry
# other than "-" (a switch's whole-model check); step = `bench step` on the K3 slice; profile = Nsight Compute of
# PROFILE's (a variant) narrow gate/up and down launches at 64 tokens. Summary in $OUT/summary.txt.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
# The variants may come packed (`tar -cJf .gpu/var.tar.xz var` in .gpu keeps the carried tree under 64 MiB).
if [[ -f $BUNDLE/var.tar.xz && ! -d $BUNDLE/var ]]; then tar -C "$BUNDLE" -xJf "$BUNDLE/var.tar.xz"; fi
export BG_GOLDEN_DIR=$BUNDLE/golden
PARTS=${PARTS:-tests micro kernels step profile}  # also: envtests; sass (cuobjdump of PROFILE, or of batchgen's
                                                  # moe_w4a16 kernels without PROFILE)
TOKENS=${TOKENS:-1 16 64}
S=$OUT/summary.txt
T=$BUNDLE/test_cuda
LOG=/tmp/combine-logs; mkdir -p $LOG
if has step; then ensure_slice /tmp/bg-ep16-rank & SLICE=$!; fi
if has tests; then
  timeout ${TEST_TIMEOUT:-300} "$T" --gtest_filter="$W4A16_TESTS" > "$OUT/tests.txt" 2>&1
  gtest_summary tests "$OUT/tests.txt" $?
fi
if has micro; then
  VARS=$(ls $BUNDLE/var)
  for round in a b; do
    for v in $VARS; do
      echo "== $v round $round" >> "$S"
      BG_W4A16_BENCH_RANDOM=1 "$BUNDLE/var/$v" $TOKENS 2>&1 | tail -20 | grep -E "^ +[0-9]|moe_decode" >> "$S"
    done
    VARS=$(echo "$VARS" | tac)
  done
fi
if has kernels; then
  # Each KERNEL_ENVS entry ("-" runs the defaults; e.g. BG_MOE_W4A16_OVERLAP=0).
  for e in ${KERNEL_ENVS:--}; do
    tag=${e//[^A-Za-z0-9]/_}
    env $([[ $e == - ]] || echo "$e") "$BG" bench kernels --device cuda --kernels moe_decode_w4a16 \
      --json "$OUT/kernels-$tag.json" > $LOG/kernels-$tag.txt 2>&1
    echo "kernels $e rc=$?" >> "$S"; grep "^moe_decode" $LOG/kernels-$tag.txt >> "$S"
  done
fi
if has envtests; then
  for e in ${KERNEL_ENVS:--}; do
    [[ $e == - ]] && continue
    tag=${e//[^A-Za-z0-9]/_}
    env "$e" timeout ${TEST_TIMEOUT:-300} "$T" --gtest_filter='Cases/GoldenGpu.*:Models/StepGpu.*' \
      > "$OUT/envtests-$tag.txt" 2>&1
    gtest_summary "envtests $e" "$OUT/envtests-$tag.txt" $?
  done
fi
if has step; then
  # Two interleaved rounds of each STEP_ENVS entry ("-" runs the defaults; e.g. BG_MOE_W4A16_NARROW=0).
  wait $SLICE
  for round in a b; do
    for e in ${STEP_ENVS:--}; do
      tag=${e//[^A-Za-z0-9]/_}
      env $([[ $e == - ]] || echo "$e") "$BG" bench step --device cuda --model /tmp/bg-ep16-rank \
        --batches ${BATCHES:-1,16,64} --contexts 4096 --json "$LOG/step-$tag-$round.json" > $LOG/step-$tag-$round.txt 2>&1
      echo "step $e round $round rc=$?" >> "$S"; grep -A8 "^step" $LOG/step-$tag-$round.txt | grep "^bg-" >> "$S"
      cp $LOG/step-$tag-$round.json "$OUT/"
    done
  done
fi
if has sass && [[ -n "${PROFILE:-}" ]]; then
  cuobjdump -sass "$BUNDLE/var/$PROFILE" | xz > "$OUT/$PROFILE-sass.txt.xz"
  echo "sass rc=$?" >> "$S"
elif has sass; then
  cuobjdump -sass "$BG" | awk '/Function : /{p = ($0 ~ /moe_w4a16_kernel/)} p' | xz > "$OUT/batchgen-w4a16-sass.txt.xz"
  echo "sass rc=$?" >> "$S"
fi
if has profile && [[ -n "${PROFILE:-}" ]]; then
  # Random routing, one token count: the wide shape's 98 launches, then the narrow shape's (gate/up, down first).
  BG_W4A16_BENCH_RANDOM=1 timeout 300 ncu --clock-control none --set full --import-source yes \
    --kernel-name regex:moe_w4a16 --launch-skip 98 --launch-count 2 -o "$OUT/$PROFILE-t64" \
    "$BUNDLE/var/$PROFILE" 64 > "$OUT/ncu-$PROFILE.txt" 2>&1
  echo "profile rc=$?" >> "$S"
  ncu -i "$OUT/$PROFILE-t64.ncu-rep" --page details > "$OUT/$PROFILE-t64-details.txt" 2>&1
  ncu -i "$OUT/$PROFILE-t64.ncu-rep" --page source --csv --print-source sass > "$OUT/$PROFILE-t64-sass.csv" 2>&1
  rm -f "$OUT/$PROFILE-t64.ncu-rep"
  grep -E "moe_w4a16_kernel|Duration|DRAM Throughput|Registers Per|Issue Slots Busy" \
    "$OUT/$PROFILE-t64-details.txt" >> "$S"
fi
cat "$S"
