#!/usr/bin/env bash
# GPU machine: the decode-step switches of 2026-12-07 (bench/RESULTS.md), each against the defaults in the same binary
# and on the same machine (bundle of scripts/gpu-bundle.sh in $BUNDLE, default .gpu). PARTS (default all, in this order):
#   w4      MoeW4a16Parity.* (the decode kernel and its switches, bit for bit)
#   kernels `bench kernels` moe_decode_w4a16 and its wgmma case, mla_decode with mla_decode_even
#   step64  `bench step` at batch 64, 4k: defaults and BG_MLA_DECODE_ALIGN=0 (the even split-KV cut only)
#           (ROUNDS rounds, default 2)
#   mla     *MlaDecode.* parity (the aligned schedule's device model and parity cases, three kernels)
#   big     `bench step` at batch 128 / 256, 4k: defaults, BG_MOE_PREFILL=w4a16 (the W4A16 prefill kernel inside the
#           decode graph; the default there since 2026-12-07, before it the decode kernel's passes),
#           BG_MLA_DECODE_ALIGN=0
#   models  the GPU goldens, step and graph tests with BG_MOE_PREFILL=w4a16
# Every result is appended to $OUT/summary.txt as it comes, so a call cut short still returns what ran.
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden
PARTS=${PARTS:-w4 kernels step64 mla big models}
ROUNDS=${ROUNDS:-2}
S=$OUT/summary.txt
T=$BUNDLE/test_cuda
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$S"
if has step64 || has big; then ensure_slice /tmp/bg-ep16-rank & SLICE=$!; fi
at() { echo "$1 at $((SECONDS - T0)) s" >> "$S"; }
steps() {  # steps TAG BATCHES ENV...: one round over the environments
  local tag=$1 batches=$2; shift 2
  for e in "$@"; do
    env $([[ $e == - ]] || echo "$e") timeout 120 "$BG" bench step --device cuda --model /tmp/bg-ep16-rank \
      --batches "$batches" --contexts 4096 --json "$OUT/step-${e//[^A-Za-z0-9]/_}-$tag.json" > /tmp/step.txt 2>&1
    echo "step $e ($tag) rc=$?" >> "$S"
    grep -E "bench step bg" /tmp/step.txt | sed 's/.*bench step //' >> "$S"
  done
}
if has w4; then
  timeout 150 "$T" --gtest_filter='MoeW4a16Parity.*' > "$OUT/parity-w4.txt" 2>&1
  gtest_summary parity-w4 "$OUT/parity-w4.txt" $?
  at "w4 parity"
fi
if has kernels; then
  "$BG" bench kernels --device cuda --json "$OUT/kernels.json" \
    --kernels 'moe_decode_w4a16$,moe_decode_w4a16_wgmma,mla_decode$,mla_decode_even' \
    > "$OUT/kernels.txt" 2>&1
  echo "kernels rc=$?" >> "$S"
  grep -E "^ *(ceilings|moe_decode|mla_decode)" "$OUT/kernels.txt" >> "$S"
  at kernels
fi
if has step64 || has big; then wait "$SLICE"; fi
if has step64; then
  for r in $(seq 1 "$ROUNDS"); do
    steps "b64-$r" 64 - BG_MLA_DECODE_ALIGN=0
  done
  at step64
fi
if has mla; then
  timeout 200 "$T" --gtest_filter='*MlaDecode.*' > "$OUT/parity-mla.txt" 2>&1
  gtest_summary parity-mla "$OUT/parity-mla.txt" $?
  at "mla parity"
fi
if has big; then
  for r in $(seq 1 "$ROUNDS"); do steps "big-$r" 128,256 - BG_MOE_PREFILL=w4a16 BG_MLA_DECODE_ALIGN=0; done
  at big
fi
if has models; then
  for e in BG_MOE_PREFILL=w4a16; do
    env "$e" timeout 150 "$T" --gtest_filter='Cases/GoldenGpu.*:Models/StepGpu.*:GraphCapture*' \
      > "$OUT/models-${e//[^A-Za-z0-9]/_}.txt" 2>&1
    gtest_summary "models $e" "$OUT/models-${e//[^A-Za-z0-9]/_}.txt" $?
  done
  at models
fi
cat "$S"
