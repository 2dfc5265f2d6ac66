#!/usr/bin/env bash
# Weight-store measurements on a GPU machine, from a carried bundle (scripts/gpu-bundle.sh build-cuda): the disk's
# sequential read rate beside weightd's disk -> store rate, store -> GPU beside the pinned host-to-device rate, and an
# engine's warm restart of the ep16-rank slice (Kimi-K3 real dimensions, 56 experts: one EP16 rank's share) to ready,
# with the projection for a full K3 rank (97 GB). Prints a table last; logs go to $OUT (default ./gpu-out/weights).
#
#   bash scripts/h200-weights-bench.sh .gpu [/path/with/space/for/the/13GB/checkpoint]
set -u
BUNDLE=${1:-.gpu}
WORK=${2:-/tmp/bg-weights-bench}
OUT=${OUT:-$PWD/gpu-out/weights}
mkdir -p "$OUT" "$WORK"
SP=/opt/torch/.venv/lib/python3.12/site-packages
export LD_LIBRARY_PATH="$BUNDLE/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}"
export BG_RUNTIME_DIR="$WORK/run"
mkdir -p "$BG_RUNTIME_DIR" && chmod 700 "$BG_RUNTIME_DIR"
BG="$BUNDLE/batchgen"
MODEL=${MODEL:-$WORK/ep16-rank}  # MODEL=dir: another checkpoint (a dry run on a tiny one)
STORE=bench$$
json() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {'d': d}))" "$@"; }
now() { date +%s.%N; }
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo yes || echo "no (not root: warm page cache)"; }
cleanup() { "$BG" weightd stop --name "$STORE" >/dev/null 2>&1; "$BG" weightd stop --name "${STORE}w" >/dev/null 2>&1; }
trap cleanup EXIT

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
df -h /dev/shm "$WORK" >> "$OUT/gpu.txt" 2>&1   # the store needs ~14 GB of /dev/shm
if [[ ! -f "$MODEL/config.json" ]]; then
  echo "making the ep16-rank checkpoint (13 GB) in $MODEL"
  "$BG" make-random --arch kimi_k3 --preset ep16-rank --out "$MODEL" --shards 8 > "$OUT/make_random.log" 2>&1 || exit 1
fi
BYTES=$(du -cb "$MODEL"/*.safetensors | tail -1 | cut -f1)

# 1. The disk: one stream, then all shards at once (O_DIRECT, cold cache where we may drop it).
COLD1=$(drop_caches)
T0=$(now); dd if="$(ls "$MODEL"/*.safetensors | head -1)" of=/dev/null bs=16M iflag=direct 2> "$OUT/dd1.log"; T1=$(now)
ONE=$(stat -c %s "$(ls "$MODEL"/*.safetensors | head -1)")
SEQ1=$(python3 -c "print(f'{$ONE/($T1-$T0)/1e9:.2f}')")
drop_caches > /dev/null
T0=$(now); for f in "$MODEL"/*.safetensors; do dd if="$f" of=/dev/null bs=16M iflag=direct 2>/dev/null & done; wait; T1=$(now)
SEQN=$(python3 -c "print(f'{$BYTES/($T1-$T0)/1e9:.2f}')")

# 2. weightd: disk -> store (cold), then the daemon killed and started again (adopts after verifying checksums).
drop_caches > /dev/null
"$BG" weightd start --model "$MODEL" --name "$STORE" > "$OUT/start.json" 2> "$OUT/start.log" || { cat "$OUT/start.log"; exit 1; }
LOAD=$(json "$OUT/start.json" "round(d['load']['gb_per_s'], 2)")
READER=$(json "$OUT/start.json" "d['load']['reader']")
kill -9 "$(json "$OUT/start.json" "d['pid']")"; sleep 1
T0=$(now); "$BG" weightd start --model "$MODEL" --name "$STORE" > "$OUT/adopt.json" 2> "$OUT/adopt.log"; T1=$(now)
ADOPT_S=$(python3 -c "print(f'{$T1-$T0:.2f}')")
ORIGIN=$(json "$OUT/adopt.json" "d['origin']")

# 3. store -> GPU beside pinned host -> device.
"$BG" weightd bench --name "$STORE" > "$OUT/bench.json" 2> "$OUT/bench.log" || cat "$OUT/bench.log"
H2D=$(json "$OUT/bench.json" "round(d['store_to_gpu_gb_per_s'], 1)")
PINNED=$(json "$OUT/bench.json" "round(d['pinned_h2d_gb_per_s'], 1)")
FRAC=$(json "$OUT/bench.json" "round(d['fraction_of_pinned'], 3)")
REG=$(json "$OUT/bench.json" "round(d['register_seconds'], 2)")

# 4. An engine's restart on the warm store to ready (load + one token), twice; the direct read for comparison.
run_ready() {  # label, extra args...
  local label=$1; shift
  local t0 t1; t0=$(now)
  "$BG" generate --model "$MODEL" --device cuda --prompt-ids 1,2,3 --max-tokens 1 "$@" > /dev/null 2> "$OUT/ready_$label.log"
  local rc=$?; t1=$(now)
  python3 -c "print(f'{$t1-$t0:.2f}' if $rc == 0 else 'failed (rc $rc)')"
}
READY1=$(run_ready store1 --weight-store "$STORE")
READY2=$(run_ready store2 --weight-store "$STORE")
# The same with MXFP4 experts packed into the W4A16 layout on the device (docs/MOE_W4A16.md), not on the host.
READY_DEV=$(export BG_MOE_W4A16_PACK=device; run_ready store_devpack --weight-store "$STORE")
# A second store holding the experts as W4A16 blocks (--expert-layout w4a16): its build's packing time, and the warm
# restart with the blocks copied as they are (BG_STORE_W4A16_DIRECT=1: no pack at load), then the default (unpacked).
STORE_W=${STORE}w
"$BG" weightd start --model "$MODEL" --name "$STORE_W" --expert-layout w4a16 > "$OUT/start_w4a16.json" \
  2> "$OUT/start_w4a16.log" || cat "$OUT/start_w4a16.log"
PACK_S=$(json "$OUT/start_w4a16.json" "round(d['load'].get('w4a16_pack_seconds', -1), 2)" 2>/dev/null || echo n/a)
READY_W1=$(export BG_STORE_W4A16_DIRECT=1; run_ready w4a16_direct1 --weight-store "$STORE_W")
READY_W2=$(export BG_STORE_W4A16_DIRECT=1; run_ready w4a16_direct2 --weight-store "$STORE_W")
READY_WU=$(run_ready w4a16_unpacked --weight-store "$STORE_W")
"$BG" weightd stop --name "$STORE_W" > /dev/null 2>&1
drop_caches > /dev/null
DIRECT=$(run_ready direct)
UPLOAD=$(grep -o "prepared [0-9]* linear weights ([0-9.]* GB) in [0-9.]* s ([0-9.]* GB/s)" "$OUT/ready_store2.log" | tail -1)
PROJ=$(python3 -c "r=float('$H2D' or 0); print(f'{97/r:.1f} s of copying at {r} GB/s' if r > 0 else 'n/a')")

{
  echo "weight store on $(head -2 "$OUT/gpu.txt" | tail -1), checkpoint $MODEL ($(python3 -c "print(f'{$BYTES/1e9:.1f}')") GB)"
  echo "| measurement | value |"
  echo "|---|---|"
  echo "| disk sequential read, 1 stream (O_DIRECT; caches dropped: $COLD1) | $SEQ1 GB/s |"
  echo "| disk sequential read, all shards at once | $SEQN GB/s |"
  echo "| weightd disk -> store ($READER) | $LOAD GB/s |"
  echo "| weightd restart after kill -9: $ORIGIN (checksums verified) | $ADOPT_S s |"
  echo "| cudaHostRegister of the store | $REG s |"
  echo "| store -> GPU (registered segments) | $H2D GB/s |"
  echo "| pinned host -> GPU (cudaMallocHost) | $PINNED GB/s |"
  echo "| store -> GPU / pinned | $FRAC |"
  echo "| engine warm restart to ready (generate 1 token), 1st / 2nd | $READY1 s / $READY2 s |"
  echo "| the same, MXFP4 experts packed on the device (BG_MOE_W4A16_PACK=device) | $READY_DEV s |"
  echo "| --expert-layout w4a16 store: packing at build | $PACK_S s |"
  echo "| the same store, blocks copied as they are (BG_STORE_W4A16_DIRECT=1), 1st / 2nd | $READY_W1 s / $READY_W2 s |"
  echo "| the same store, blocks unpacked and packed again (default) | $READY_WU s |"
  echo "| engine from the files (no store, cold cache) | $DIRECT s |"
  echo "| engine upload (log) | $UPLOAD |"
  echo "| projection, a K3 EP16 rank's 97 GB | $PROJ |"
} | tee "$OUT/summary.md"
