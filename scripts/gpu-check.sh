#!/usr/bin/env bash
# One GPU session's checks from a carried bundle (scripts/gpu-bundle.sh): unpacks .gpu/bundle.tar.xz when present, then
# runs the named steps, each with a time limit, logging to $OUT/<step>.log and a one-line status to $OUT/summary.txt.
#   scripts/gpu-check.sh STEP...     steps: parity, wgmma, w4a16-bench, mla-bench, bench, bench-quick, serve, load, golden,
#                                    cuda=GTEST_FILTER (test_cuda with that filter), kernels=NAME (bench kernels --kernels)
#                                    moe-prefill (the grouped expert path's tests and bench cases, docs/MOE_PREFILL.md)
# Meant for the H200 machine (torch's CUDA libraries beside the bundle's own).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
B=.gpu
if [[ -f $B/bundle.tar.xz && ! -x $B/batchgen ]]; then tar -C $B -xJf $B/bundle.tar.xz; fi
SP=/opt/torch/.venv/lib/python3.12/site-packages
export LD_LIBRARY_PATH="$B/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:$SP/nvidia/cudnn/lib:${LD_LIBRARY_PATH:-}"
export BG_GOLDEN_DIR="$B/golden"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.log" | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
}
n=0
for step in "$@"; do
  case $step in
    parity) run parity 420 $B/test_cuda --gtest_filter='-Wgmma/*:*DISABLED*' ;;
    wgmma) run wgmma 240 $B/test_cuda --gtest_filter='Wgmma/MlaDecode.*' ;;
    w4a16-bench) run w4a16_bench 180 $B/test_cuda --gtest_also_run_disabled_tests --gtest_filter='MoeW4a16Bench.*' ;;
    mla-bench) run mla_bench 240 $B/test_cuda --gtest_also_run_disabled_tests --gtest_filter='MlaDecodeBench.*' ;;
    golden) run golden 300 $B/test_cuda --gtest_filter='*Golden*:*StepGpu*' ;;
    moe-prefill)
      run moe_prefill 300 $B/test_cuda --gtest_filter='MoeGroupedParity.*:MoeCudaParity.*:Cases/GoldenGpu.*'
      run moe_prefill_bench 420 $B/batchgen bench kernels --device cuda --kernels moe_prefill \
        --json "$OUT/moe_prefill.json" ;;
    bench-quick) run bench_quick 300 $B/batchgen bench all --device cuda --quick --json "$OUT/bench_quick.json" ;;
    bench) run bench "${BG_BENCH_LIMIT_S:-560}" bench/run-h200.sh $B ${BG_BENCH_ARGS:-} ;;
    serve) run serve 240 scripts/gpu-serve-check.sh $B ;;
    load) run load 400 scripts/gpu-load-check.sh $B ;;
    cuda=*) n=$((n + 1)); run "cuda$n" "${BG_STEP_LIMIT_S:-300}" $B/test_cuda --gtest_filter="${step#cuda=}" ;;
    kernels=*) n=$((n + 1)); run "kernels$n" "${BG_STEP_LIMIT_S:-300}" $B/batchgen bench kernels --device cuda \
                 --kernels "${step#kernels=}" --json "$OUT/kernels$n.json" ;;
    *) echo "unknown step $step" | tee -a "$OUT/summary.txt" ;;
  esac
done
grep -hE "^\[  FAILED  \]" "$OUT"/*.log | sort -u | head -40 >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
