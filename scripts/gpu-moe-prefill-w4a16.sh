#!/usr/bin/env bash
# The W4A16 prefill kernel on the H200 (docs/MOE_PREFILL.md, "The W4A16 prefill kernel"): its parity tests and the
# decode kernel's (the shared device header changed), the goldens, step tests and streamed experts with the backend
# on it (BG_MOE_PREFILL=w4a16; the goldens force every prefill step onto the prefill paths), the kernel cases beside
# the dequantize-once path and the bf16 grouped GEMM ceiling, the crossover with the fused decode kernel (18 to 292
# rows per expert: where its lower threshold belongs), and the slice's prefill with each path (BG_MOE_PREFILL=auto, the
# default, takes it at 32..511 rows per expert).
# PARTS also takes "plans" (the 64k prompt twice per path), "ncu" (Nsight Compute with the stall breakdown) and "sass"
# (the kernel's SASS from cuobjdump, xz'd into $OUT/prefill_kernel.sass.xz, with a count of its wgmma waits: dump_sass).
# Run from the repo root with the bundle carried:
#   PARTS="parity bench prefill" scripts/gpu-moe-prefill-w4a16.sh [BUNDLE]
# Output: $OUT/w4a16-prefill.txt (the summary) and logs beside it.
set -u
PARTS=${PARTS:-parity bench prefill}
want() { [[ " $PARTS " == *" $1 "* ]]; }
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
source "$(dirname "$0")/gpu-bundle-env.sh"
export BG_GOLDEN_DIR="$BUNDLE/golden"
T="$BUNDLE/test_cuda"
S=$OUT/w4a16-prefill.txt
: > "$S"
if want parity; then
  timeout 300 "$T" --gtest_filter='MoeW4a16Prefill.*:MoeW4a16Parity.*:MoeCudaParity.*' > "$OUT/parity.log" 2>&1
  gtest_summary "parity MoeW4a16Prefill + MoeW4a16Parity + MoeCudaParity (dispatch)" "$OUT/parity.log" $?
  BG_MOE_PREFILL=w4a16 timeout 300 "$T" \
    --gtest_filter='Cases/GoldenGpu.*:Models/StepGpu.*:Archs/*:Cases/StreamedExpertsGpu.*:Cases/W4a16StoreGpu.*' \
    > "$OUT/goldens.log" 2>&1
  gtest_summary "goldens, step, Archs, streamed experts with BG_MOE_PREFILL=w4a16" "$OUT/goldens.log" $?
fi
if want bench; then
  timeout 500 "$BG" bench kernels --device cuda --kernels moe_prefill,moe_crossover \
    --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "bench kernels rc=$?" >> "$S"
  grep -E "moe_prefill|moe_crossover|grouped" "$OUT/kernels.log" >> "$S"
fi
if want prefill; then
  ensure_slice /tmp/bg-ep16-rank
  for k in grouped w4a16; do
    BG_MOE_PREFILL=$k timeout 300 "$BG" bench prefill --device cuda --model /tmp/bg-ep16-rank \
      --prefill-tokens "${PREFILL_TOKENS:-8192,65536}" --prefill-chunk 8192 --json "$OUT/prefill-$k.json" \
      > "$OUT/prefill-$k.log" 2>&1
    echo "bench prefill BG_MOE_PREFILL=$k rc=$?" >> "$S"
    grep -E "tokens/s|prefill .* ms" "$OUT/prefill-$k.log" | tail -4 >> "$S"
  done
fi
# Whether the dequantize-once path's long-prompt slowdown is cuDNN plan builds on the step thread (MOE_PREFILL.md): the
# 64k prompt twice in one process, each path; the second run finds every plan built.
if want plans; then
  ensure_slice /tmp/bg-ep16-rank
  for k in grouped w4a16; do
    BG_MOE_PREFILL=$k timeout 300 "$BG" bench prefill --device cuda --model /tmp/bg-ep16-rank \
      --prefill-tokens 65536,65536 --prefill-chunk 8192 > "$OUT/plans-$k.log" 2>&1
    echo "bench prefill 64k twice, BG_MOE_PREFILL=$k rc=$?" >> "$S"
    grep -E "tokens/s" "$OUT/plans-$k.log" | tail -2 >> "$S"
  done
fi
if want sass; then
  dump_sass "$BG" prefill_kernel  # whether ptxas keeps several wgmma groups in flight (HGMMA beside DEPBAR)
fi
if want ncu; then
  timeout 240 ncu --clock-control none --kernel-name regex:prefill_kernel --launch-skip 4 --launch-count 2 \
    --set full -o "$OUT/pf" "$BG" bench kernels --device cuda --kernels 'moe_prefill_w4a16' > "$OUT/ncu.log" 2>&1
  ncu --import "$OUT/pf.ncu-rep" --page details > "$OUT/details.txt" 2>&1
  # The stall breakdown: warp-state samples per reason (the largest first), for the next optimisation step.
  ncu --import "$OUT/pf.ncu-rep" --page raw --csv 2> /dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
if len(rows) < 3: sys.exit()
head = rows[0]
for r in rows[2:]:
    name = r[head.index("Kernel Name")][:60] if "Kernel Name" in head else "?"
    stalls = []
    for i, h in enumerate(head):
        if h.startswith(("smsp__average_warp_latency_issue_stalled_", "smsp__pcsamp_warps_issue_stalled_")):
            try: stalls.append((float(r[i].replace(",", "")), h))
            except ValueError: pass
    print(name)
    for v, h in sorted(stalls, reverse=True)[:12]: print(f"  {h}: {v:g}")
' > "$OUT/stalls.txt" 2>&1
  # Per SASS instruction: the warp-state samples (where the stalls are), the hottest 60 and the sums per opcode.
  ncu --import "$OUT/pf.ncu-rep" --page source --csv --print-source sass > "$OUT/source.csv" 2> "$OUT/source.err"
  python3 - "$OUT/source.csv" > "$OUT/hot.txt" 2>&1 <<'PY'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
head = next((r for r in rows if "Source" in r), None)
if head is None: sys.exit("no source table")
src = head.index("Source")
col = next(i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All"))
body = [r for r in rows[rows.index(head) + 1:] if len(r) == len(head)]
def val(r):
    try: return float(r[col].replace(",", ""))
    except ValueError: return 0.0
total = sum(val(r) for r in body) or 1.0
ops = collections.Counter()
for r in body: ops[r[src].split()[0] if r[src].split() else "?"] += val(r)
print("samples per opcode (share):")
for op, v in ops.most_common(25): print(f"  {op:24s} {v / total:6.3f}")
print("hottest instructions:")
for r in sorted(body, key=val, reverse=True)[:60]: print(f"  {val(r) / total:6.3f}  {r[0]}  {r[src][:110]}")
PY
  xz -T2 "$OUT/source.csv"
  rm -f "$OUT/pf.ncu-rep"
  grep -E "Duration|Executed Instructions  |Issue Slots Busy|Tensor|DRAM Throughput|L2 Cache Throughput|Registers Per" \
    "$OUT/details.txt" >> "$S"
  cat "$OUT/stalls.txt" >> "$S"
  head -50 "$OUT/hot.txt" >> "$S"
fi
cat "$S"
