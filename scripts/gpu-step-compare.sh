#!/usr/bin/env bash
# GPU machine: this bundle's batchgen against a baseline build of it (.gpu/base.xz: `xz -c build-before/batchgen`),
# interleaved on one machine. PARTS (default "tests kernels step kernel-times profile"):
#   tests         TESTS (a gtest filter) on this bundle's test_cuda
#   kernels       `bench kernels --kernels KERNELS` on both binaries, ROUNDS times, interleaved
#   step          `bench step` at BATCHES x CONTEXTS on the K3 slice, both binaries, ROUNDS times, interleaved
#   kernel-times  Nsight Compute's gpu__time_duration of the kernels matching TIMED (a regex) in the step at B = 64,
#                 both binaries (ncu serialises the kernels)
#   profile       Nsight Compute --set full of PROFILE_COUNT launches matching PROFILE after PROFILE_SKIP of them, in
#                 the step at B = 64 (this bundle only; the details page in $OUT)
# $OUT gets the summary (summary.txt), the tests' log, the step reports of the last round and the profile's details
# (the device tool returns a few files only); the rest stays in /tmp/compare-logs.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden
PARTS=${PARTS:-tests kernels step kernel-times profile}
S=$OUT/summary.txt
LOG=/tmp/compare-logs; mkdir -p $LOG
BASE=/tmp/bg-base
xz -dc "$BUNDLE/base.xz" > $BASE && chmod +x $BASE
ensure_slice /tmp/bg-ep16-rank & SLICE=$!
if has tests; then
  timeout ${TEST_TIMEOUT:-240} "$BUNDLE/test_cuda" --gtest_filter="${TESTS:-*}" > "$OUT/tests.txt" 2>&1
  gtest_summary tests "$OUT/tests.txt" $?
fi
wait $SLICE
for r in ${ROUNDS:-a b}; do
  for b in new base; do
    B=$BG; [[ $b == base ]] && B=$BASE
    if has kernels; then
      $B bench kernels --device cuda --kernels "${KERNELS:-mla_decode}" > "$LOG/kernels-$b-$r.txt" 2>&1
      echo "kernels $b $r rc=$?" >> "$S"; grep -E "^(${KERNELS_SHOW:-mla_decode}) " "$LOG/kernels-$b-$r.txt" >> "$S"
    fi
    if has step; then
      $B bench step --device cuda --model /tmp/bg-ep16-rank --batches "${BATCHES:-16,64}" \
        --contexts "${CONTEXTS:-4096,32768}" --json "$LOG/step-$b-$r.json" > "$LOG/step-$b-$r.txt" 2>&1
      echo "step $b $r rc=$?" >> "$S"; grep -E "bench step bg" "$LOG/step-$b-$r.txt" | sed 's/.*bench step //' >> "$S"
      cp "$LOG/step-$b-$r.json" "$OUT/step-$b.json"
    fi
  done
done
if has kernel-times; then
  for b in new base; do
    B=$BG; [[ $b == base ]] && B=$BASE
    timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "regex:${TIMED:-.}" \
      --launch-count 40 "$B" bench step --device cuda --model /tmp/bg-ep16-rank --batches 64 --contexts 4096 \
      > "$LOG/times-$b.csv" 2> /dev/null
    echo "kernel-times $b rc=$? (us, kernel)" >> "$S"
    python3 - "$LOG/times-$b.csv" >> "$S" <<'PY'
import csv, sys, collections, statistics
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14 and r[0] != 'ID']
by = collections.defaultdict(list)
for r in rows: by[r[4][:60]].append(float(r[14].replace(',', '')) / 1000)
for k, v in by.items(): print(f"  {statistics.median(v):8.1f}  {k}  (median of {len(v)})")
PY
  done
fi
if has profile; then
  timeout 200 ncu --clock-control none --set full --kernel-name "regex:${PROFILE:-moe_w4a16_kernel}" \
    --launch-skip "${PROFILE_SKIP:-6}" --launch-count "${PROFILE_COUNT:-2}" -o "$OUT/profile" \
    "$BG" bench step --device cuda --model /tmp/bg-ep16-rank --batches 64 --contexts 4096 > "$LOG/ncu.log" 2>&1
  echo "profile rc=$?" >> "$S"
  ncu -i "$OUT/profile.ncu-rep" --page details > "$OUT/profile-details.txt" 2>&1
  rm -f "$OUT/profile.ncu-rep"
  grep -E "^  [a-z_:<>, 0-9()]*kernel|Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps" \
    "$OUT/profile-details.txt" >> "$S"
fi
cat "$S"
