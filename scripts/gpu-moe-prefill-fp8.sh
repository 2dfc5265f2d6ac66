#!/usr/bin/env bash
# The FP8 prefill path on a GPU (docs/MOE_PREFILL.md, "The FP8 path"): its parity tests (MoeFp8Parity.*: the stages
# against the host, end to end against the exact reference) and the grouped path's beside it, the kernel cases beside
# the W4A16 prefill kernel and the dequantize-once path (fractions of the same run's bf16 grouped GEMM ceiling), the
# goldens with BG_MOE_PREFILL=fp8 (the path's effect on them: E4M3 activations are not the model's arithmetic, so
# failures there are the measurement, recorded, not a regression), and the slice's prefill on it. Run from the repo
# root with the bundle carried:
#   PARTS="parity bench goldens prefill ncu" scripts/gpu-moe-prefill-fp8.sh [BUNDLE]
# (ncu: Nsight Compute's details of one launch of the W4A16 -> E4M3 conversion, from its bench case)
# KERNELS narrows the bench cases, MODES the BG_MOE_PREFILL values the slice's prefill runs with (default "fp8 auto").
# Output: $OUT/fp8-prefill.txt (the summary) and logs beside it.
set -u
PARTS=${PARTS:-parity bench goldens prefill}
want() { [[ " $PARTS " == *" $1 "* ]]; }
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
source "$(dirname "$0")/gpu-bundle-env.sh"
export BG_GOLDEN_DIR="$BUNDLE/golden"
T="$BUNDLE/test_cuda"
S=$OUT/fp8-prefill.txt
: > "$S"
if want parity; then
  timeout 240 "$T" --gtest_filter="${PARITY:-MoeFp8Parity.*:MoeGroupedParity.*}" > "$OUT/parity.log" 2>&1
  gtest_summary "parity ${PARITY:-MoeFp8Parity.*:MoeGroupedParity.*}" "$OUT/parity.log" $?
  grep -E "\[parity\]" "$OUT/parity.log" | grep -E "fp8|end to end|gate\|up|y =" | head -40 >> "$S"
fi
if want bench; then
  timeout 300 "$BG" bench kernels --device cuda --kernels "${KERNELS:-moe_prefill_fp8,moe_prefill_w4a16,moe_prefill_grouped_per_expert}" \
    --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "bench kernels rc=$?" >> "$S"
  grep -E "bench kernel|grouped_gemm|ceiling" "$OUT/kernels.log" | sed 's/^.*\] //' | head -40 >> "$S"
fi
if want goldens; then
  BG_MOE_PREFILL=fp8 timeout 200 "$T" --gtest_filter='Cases/GoldenGpu.*' > "$OUT/goldens.log" 2>&1
  gtest_summary "goldens with BG_MOE_PREFILL=fp8 (BG_MOE_GROUPED_MIN_ROWS=1: every prefill step on it)" "$OUT/goldens.log" $?
  grep -E "\[gpu golden\]" "$OUT/goldens.log" | head -20 >> "$S"
fi
if want prefill; then
  ensure_slice /tmp/bg-ep16-rank
  for k in ${MODES:-fp8 auto}; do
    BG_MOE_PREFILL=$k timeout 200 "$BG" bench prefill --device cuda --model /tmp/bg-ep16-rank \
      --prefill-tokens "${PREFILL_TOKENS:-8192,65536}" --prefill-chunk 8192 --json "$OUT/prefill-$k.json" \
      > "$OUT/prefill-$k.log" 2>&1
    echo "bench prefill BG_MOE_PREFILL=$k rc=$?" >> "$S"
    grep -E "tokens/s|prefill .* ms|chunk ms|error" "$OUT/prefill-$k.log" | tail -8 >> "$S"
  done
fi
if want ncu; then
  timeout 180 ncu --clock-control none --kernel-name regex:convert_w4a16 --launch-skip 2 --launch-count 1 --set full \
    -o "$OUT/convert" "$BG" bench kernels --device cuda --kernels moe_prefill_fp8_convert > "$OUT/ncu.log" 2>&1
  echo "ncu rc=$?" >> "$S"
  ncu --import "$OUT/convert.ncu-rep" --page details > "$OUT/convert-details.txt" 2>&1
  rm -f "$OUT/convert.ncu-rep"
  grep -E "Duration|Executed Instructions  |Issue Slots Busy|DRAM Throughput|Registers Per|Achieved Occ|L1/TEX Hit|\
L2 Hit|Mem Busy|Stall|Local" "$OUT/convert-details.txt" | head -30 >> "$S"
fi
cat "$S"
