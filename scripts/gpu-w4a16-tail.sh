#!/usr/bin/env bash
# GPU machine: where the W4A16 kernel's SMs sit idle at 64 tokens. Nsight Compute of the experiment binary
# .gpu/var/final (scripts/w4a16-variant-build.sh, packed as .gpu/var.tar.xz) on a random top-16 of 56 experts: the
# first replayed gate/up and down launches (skip 18: the attribute call's 2 and the warm-up graph's 16), with the SM
# active cycles (min / average / max) beside the elapsed ones; then `bench step` at batch 64 with the op trace.
set -u
OUT=${OUT:-/tmp/out}
BUNDLE=.gpu; source scripts/gpu-bundle-env.sh
[[ -d .gpu/var ]] || tar -C .gpu -xJf .gpu/var.tar.xz
ensure_slice /tmp/bg-ep16-rank & SL=$!
BG_W4A16_BENCH_RANDOM=1 timeout 200 ncu --clock-control none --set full --metrics sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_elapsed.max --kernel-name regex:moe_w4a16 --launch-skip 18 --launch-count 2 -o $OUT/wide64 .gpu/var/final 64 > $OUT/ncu.txt 2>&1
ncu -i $OUT/wide64.ncu-rep --page details > $OUT/wide64-details.txt 2>&1
ncu -i $OUT/wide64.ncu-rep --page raw --csv --metrics sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_elapsed.max,gpu__time_duration.sum > $OUT/wide64-raw.csv 2>&1
rm -f $OUT/wide64.ncu-rep
wait $SL
BG_BENCH_OP_TRACE=1 timeout 150 $BG bench step --device cuda --model /tmp/bg-ep16-rank --batches 64 --contexts 4096 > $OUT/trace64.txt 2>&1
grep -E "Duration|DRAM Throughput|Local Memory Spilling Requests |moe_w4a16_kernel<" $OUT/wide64-details.txt; cat $OUT/wide64-raw.csv | tail -3; grep -E "moe_routed_local|ms \(roofline" $OUT/trace64.txt | sed 's/.*op trace/op trace/'
