#!/usr/bin/env bash
# Runs the GPU checks on a CUDA machine from a carried bundle (see scripts/gpu-bundle.sh): the op-parity and GPU
# golden tests, then score/generate on the GPU. Logs go to $OUT (or ./gpu-out).
set -u
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
SP=/opt/torch/.venv/lib/python3.12/site-packages
export LD_LIBRARY_PATH="$BUNDLE/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
export BG_GOLDEN_DIR="$BUNDLE/golden"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
"$BUNDLE/test_cuda" --gtest_output=xml:"$OUT/test_cuda.xml" > "$OUT/test_cuda.log" 2>&1
echo "test_cuda rc=$?" | tee -a "$OUT/summary.txt"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |gpu golden|tests ran" "$OUT/test_cuda.log" | tee -a "$OUT/summary.txt"
for c in deepseek_v3/tiny-fp8 kimi_k3/k3-tiny; do
  "$BUNDLE/batchgen" generate --model "$BUNDLE/golden/$c/model" --prompt-ids 1,2,3,4,5 --max-tokens 8 --device cuda \
    >> "$OUT/summary.txt" 2>> "$OUT/generate.log"
  echo "generate $c (cuda) rc=$?" >> "$OUT/summary.txt"
  "$BUNDLE/batchgen" generate --model "$BUNDLE/golden/$c/model" --prompt-ids 1,2,3,4,5 --max-tokens 8 --device cpu \
    >> "$OUT/summary.txt" 2>> "$OUT/generate.log"
  echo "generate $c (cpu) rc=$?" >> "$OUT/summary.txt"
done
