#!/usr/bin/env bash
# GPU machine: runs each W4A16 experiment binary in .gpu/var (scripts/w4a16-variant-build.sh; the K3 bench table),
# then Nsight Compute source-level profiles of PROFILE (a variant name) at ROWS_SKIPS ("rows:launches-to-skip"; 98
# kernel launches per bench config).
set -uo pipefail
BUNDLE=${BUNDLE:-.gpu}; OUT=${OUT:-/tmp/out}
source scripts/gpu-bundle-env.sh
for v in .gpu/var/*; do
  echo "== $(basename "$v")"; "$v" 2>&1 | tail -30
done | tee "$OUT/variants.txt"
if [[ -n "${PROFILE:-}" ]]; then
  for rs in ${ROWS_SKIPS:-16:392}; do
    r=${rs%%:*}; s=${rs##*:}
    ncu --clock-control none --set full --import-source yes --kernel-name regex:moe_w4a16 --launch-skip "$s" \
      --launch-count 1 -o "$OUT/$PROFILE-rows$r" ".gpu/var/$PROFILE" > "$OUT/ncu-$PROFILE-rows$r.txt" 2>&1
    ncu -i "$OUT/$PROFILE-rows$r.ncu-rep" --page source --csv --print-source sass > "$OUT/$PROFILE-rows$r-sass.csv" 2>&1
    ncu -i "$OUT/$PROFILE-rows$r.ncu-rep" --page details > "$OUT/$PROFILE-rows$r-details.txt" 2>&1
    rm -f "$OUT/$PROFILE-rows$r.ncu-rep"
  done
fi
