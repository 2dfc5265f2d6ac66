#!/usr/bin/env bash
# The whole `batchgen bench` on the H200 machine: writes the K3 EP16 rank slice once (make-random, 13.3 GB, kept in
# $BG_BENCH_MODEL for later runs), then runs every part and writes bench/h200.json and the table to bench/h200.txt.
# Run from the repository root with the bundle of scripts/gpu-bundle.sh build-cuda:   bench/run-h200.sh .gpu
set -euo pipefail
BUNDLE=${1:-.gpu}
SP=/opt/torch/.venv/lib/python3.12/site-packages
export LD_LIBRARY_PATH="$BUNDLE/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
MODEL=${BG_BENCH_MODEL:-/tmp/bg-ep16-rank}
mkdir -p bench
if [[ ! -f "$MODEL/model.safetensors.index.json" ]]; then
  "$BUNDLE/batchgen" make-random --arch kimi_k3 --preset ep16-rank --out "$MODEL" --force
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv >&2 || true
"$BUNDLE/batchgen" bench all --device cuda --model "$MODEL" --json bench/h200.json "${@:2}" | tee bench/h200.txt
