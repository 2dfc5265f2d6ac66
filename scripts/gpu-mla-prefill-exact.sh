#!/usr/bin/env bash
# MLA prefill's cuDNN plans with and without the exact-bucket form (docs/MLA_PREFILL.md, "Exact plans") on the H200:
# the prefill parity tests, then the mla_prefill path and its attention alone with exact plans (the default) and with
# BG_MLA_CUDNN_EXACT=0, the attention on cuDNN's other engine configs, and torch's SDPA on the same shapes (the peer
# figure of ../shared/docs/H200.md) when the GPU machine's torch is there.
#   scripts/gpu-mla-prefill-exact.sh [BUNDLE]
# Output: $OUT/mla-prefill-exact.txt (the summary), the JSON and logs beside it.
set -u
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
source "$(dirname "$0")/gpu-bundle-env.sh"
export BG_GOLDEN_DIR="$BUNDLE/golden"
SUMMARY="$OUT/mla-prefill-exact.txt"
: > "$SUMMARY"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >> "$SUMMARY"
timeout 300 "$BUNDLE/test_cuda" \
  --gtest_filter='MlaPrefillCuda.*:MlaPrefillCudnn.*:Cases/GoldenGpu.*:Models/StepGpu.*:BackendDiff.*' \
  > "$OUT/parity.log" 2>&1
echo "parity rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/parity.log" | tr '\n' ' ')" >> "$SUMMARY"
grep -E '^\[  FAILED|cudnn\] ' "$OUT/parity.log" | head -20 >> "$SUMMARY"
for exact in 1 0; do
  BG_MLA_CUDNN_EXACT=$exact SPDLOG_LEVEL=debug timeout 200 "$BG" bench kernels --device cuda \
    --kernels 'mla_prefill$,mla_prefill_attention' --json "$OUT/kernels-exact$exact.json" \
    > "$OUT/kernels-exact$exact.log" 2>&1
  echo "kernels exact=$exact rc=$?" >> "$SUMMARY"
  grep -E "bench kernel mla_prefill|plan for" "$OUT/kernels-exact$exact.log" | sed 's/^.*\] //' >> "$SUMMARY"
done
for cfg in ${CONFIGS:-1 2 3}; do
  BG_MLA_CUDNN_ENGINE_CONFIG=$cfg SPDLOG_LEVEL=debug timeout 120 "$BG" bench kernels --device cuda \
    --kernels 'mla_prefill_attention' > "$OUT/kernels-config$cfg.log" 2>&1
  echo "attention on engine config $cfg: rc=$?" >> "$SUMMARY"
  grep -E "bench kernel mla_prefill|plan for" "$OUT/kernels-config$cfg.log" | sed 's/^.*\] //' >> "$SUMMARY"
done
PY=/opt/torch/.venv/bin/python
if [[ -x $PY ]]; then
  timeout 120 "$PY" "$(dirname "$0")/../bench/probes/torch_sdpa_mla.py" 4096 16384 >> "$SUMMARY" 2>&1
fi
cat "$SUMMARY"
