#!/usr/bin/env bash
# GPU machine: the bundle's batchgen (scripts/gpu-bundle.sh, in $BUNDLE, default .gpu) against other builds of it (an
# older commit, experiment branches), measured interleaved on the same machine. Each other binary goes xz'd into
# $BUNDLE/old/NAME.xz (about 7 MB each: the bundle and three of them fit the 64 MiB carry), e.g. built from a
# worktree, where ccache makes it a minute or two:
#   git worktree add /work/old <commit> && cmake -S /work/old -B /work/old/build-cuda -G Ninja \
#     -DCMAKE_BUILD_TYPE=Release && ninja -C /work/old/build-cuda batchgen
#   mkdir -p .gpu/old && xz -T2 -c /work/old/build-cuda/batchgen > .gpu/old/NAME.xz
# The bundle's binary is "new"; the others are named by their files. Parity runs the bundle's test_cuda only.
# PARTS (default all, in this order):
#   sass    per binary, the SASS of the kernels whose names match SASS_RE (default prefill_kernel) from cuobjdump, xz'd
#           into $OUT/NAME.sass.xz, and a count of the wgmma issues, waits and barriers in it
#   parity  the bundle's test_cuda with the gtest filter TESTS (default: the W4A16 kernels' and the paths running them)
#   kernels `bench kernels --kernels KERNELS` (default moe_decode_w4a16), every binary in turn, ROUNDS rounds
#   step    `bench step --batches BATCHES --contexts CONTEXTS` (defaults 16,64 and 4096), every binary in turn
#   full    the whole test_cuda (up to FULL_S seconds, default 300; with BUDGET_S set, at most what is left of it)
# Every result is appended to $OUT/summary.txt as it comes, so a call cut short still returns what ran. PACK=1 packs
# everything else under $OUT into $OUT/pack-N.tar.xz at the end (the device tool returns only a few files per call).
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
export BG_GOLDEN_DIR=$BUNDLE/golden BG_BATCHGEN=$PWD/$BUNDLE/batchgen
PARTS=${PARTS:-sass parity kernels step full}
ROUNDS=${ROUNDS:-2}
TESTS=${TESTS:-$W4A16_TESTS}
KERNELS=${KERNELS:-moe_decode_w4a16}
BATCHES=${BATCHES:-16,64}
CONTEXTS=${CONTEXTS:-4096}
script_start
declare -A BIN=([new]=$BG)
NAMES=(new)
for f in "$BUNDLE"/old/*.xz; do
  [[ -f $f ]] || continue
  name=$(basename "$f" .xz)
  [[ -x $BUNDLE/old/$name ]] || { xz -dc "$f" > "$BUNDLE/old/$name" && chmod +x "$BUNDLE/old/$name"; }
  BIN[$name]=$BUNDLE/old/$name
  NAMES+=("$name")
done
for v in "${NAMES[@]}"; do echo "$v: $("${BIN[$v]}" --version | head -1)" >> "$S"; done
if has sass; then
  for v in "${NAMES[@]}"; do dump_sass "${BIN[$v]}" "$v" "${SASS_RE:-prefill_kernel}"; done
  at sass
fi
if has parity; then
  timeout 300 "$T" --gtest_filter="$TESTS" > "$OUT/parity.txt" 2>&1
  gtest_summary parity "$OUT/parity.txt" $?
  at parity
fi
if has kernels; then
  for r in $(seq 1 "$ROUNDS"); do
    for v in "${NAMES[@]}"; do
      timeout 200 "${BIN[$v]}" bench kernels --device cuda --kernels "$KERNELS" --json "$OUT/kernels-$v-$r.json" \
        > "$OUT/kernels-$v-$r.txt" 2>&1
      echo "kernels $v ($r) rc=$?" >> "$S"
      awk 'p && NF > 3; /^kernel +shape/ {p = 1}' "$OUT/kernels-$v-$r.txt" >> "$S"
    done
  done
  at kernels
fi
if has step; then
  wait "$SLICE"
  for r in $(seq 1 "$ROUNDS"); do
    for v in "${NAMES[@]}"; do
      timeout 200 "${BIN[$v]}" bench step --device cuda --model /tmp/bg-ep16-rank --batches "$BATCHES" \
        --contexts "$CONTEXTS" --json "$OUT/step-$v-$r.json" > "$OUT/step-$v-$r.txt" 2>&1
      echo "step $v ($r) rc=$?" >> "$S"
      grep -E "^bg-ep16-rank +[0-9]+ +[0-9]+ " "$OUT/step-$v-$r.txt" >> "$S"
    done
  done
  at step
fi
if has full; then
  full_s=${FULL_S:-300}
  left=$((${BUDGET_S:-0} - (SECONDS - T0)))
  if [[ -n ${BUDGET_S:-} && $left -lt $full_s ]]; then full_s=$left; fi
  timeout "$full_s" "$T" --gtest_brief=1 > "$OUT/test_cuda.txt" 2>&1
  gtest_summary full "$OUT/test_cuda.txt" $?
  at full
fi
if [[ ${PACK:-0} == 1 ]]; then  # pack-1.tar.xz, pack-2.tar.xz, ... one per run of this script in the same $OUT
  (cd "$OUT" && files=$(ls | grep -v -x -e summary.txt -e 'pack-[0-9]*\.tar\.xz') && [[ -n $files ]] &&
    n=$(($(ls pack-*.tar.xz 2> /dev/null | wc -l) + 1)) && tar -cJf "pack-$n.tar.xz" $files && rm -f $files)
fi
cat "$S"
