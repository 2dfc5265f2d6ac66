#!/usr/bin/env bash
# The whole `batchgen bench` on the H200 machine: writes the K3 EP16 rank slice once (make-random, 13.3 GB, kept in
# $BG_BENCH_MODEL for later runs on the same machine), then runs every part and writes bench/h200.json and the stdout
# table bench/h200.txt (also copied to $OUT when set, e.g. by the device runner). Extra arguments go to `bench`.
# Run from the repository root with the bundle of `scripts/gpu-bundle.sh build-cuda`:   bench/run-h200.sh .gpu
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
rc=0
"$BUNDLE/batchgen" bench all --device cuda --model "$MODEL" --json bench/h200.json "${@:2}" > bench/h200.txt || rc=$?
cat bench/h200.txt
if [[ -n "${OUT:-}" ]]; then cp bench/h200.json bench/h200.txt "$OUT"/ 2>/dev/null || true; fi
exit $rc
