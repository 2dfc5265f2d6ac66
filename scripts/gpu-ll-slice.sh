#!/usr/bin/env bash
# The ep16-rank slice (Kimi-K3 real dimensions, 56 experts) generated greedily by one CUDA rank and by 2, 4 and 8 ranks
# sharing this GPU over the ll exchange (and ll-fp8): with the kernels pinned (the W4A16 layout off, i.e. the stage
# kernels, tiled FFN, no grouped path; linear groups part by part, since one rank fuses K3's latent-down with the shared
# experts' gate and up into one GEMM where a rank set cannot, and cuBLAS rounds the two shapes differently) a row's arithmetic does not depend on the rank count, so the ll runs must
# print the same ids as the one-rank run; ll-fp8 and the unpinned runs are printed beside them. Prints one line per run.
#   scripts/gpu-ll-slice.sh BUNDLE [WORKDIR]
set -u -o pipefail
B=${1:-.gpu}
WORK=${2:-/tmp/bg-ll-slice}
M=$WORK/ep16-rank
mkdir -p "$WORK"
if [[ ! -f $M/config.json ]]; then
  "$B/batchgen" make-random --arch kimi_k3 --preset ep16-rank --out "$M" --shards 8 > "$WORK/make_random.log" 2>&1 ||
    { tail -5 "$WORK/make_random.log"; exit 1; }
fi
ids=$(python3 -c "import random; r=random.Random(5); print(','.join(str(r.randrange(1000, 150000)) for _ in range(64)))")
gen() {  # gen LABEL ARGS...: prints LABEL, seconds, the generated ids
  local label=$1; shift
  local t0=$SECONDS out
  out=$("$B/batchgen" generate --model "$M" --device cuda --prompt-ids "$ids" --max-tokens 48 --ignore-eos "$@" \
        2> "$WORK/$label.err" | tail -1)
  local rc=$?
  echo "$label rc=$rc $((SECONDS - t0))s $out"
  [[ $rc == 0 ]] || tail -3 "$WORK/$label.err"
  eval "out_$label=\"\$out\""
}
pinned() { BG_LINEAR_GROUPS=0 BG_MOE_W4A16=0 BG_MOE_FFN_PATH=tiled BG_MOE_GROUPED_MIN_ROWS=1000000000 "$@"; }
pinned gen one
for n in 2 4 8; do pinned gen "ll$n" --ep "$n" --k3-moe-exchange ll; done
gen ll4_default --ep 4 --k3-moe-exchange ll
gen ll4_fp8 --ep 4 --k3-moe-exchange ll-fp8
gen one_default
status=0
for n in 2 4 8; do
  v="out_ll$n"
  if [[ -n "${!v}" && "${!v}" == "$out_one" ]]; then echo "ll$n: SAME as one rank"; else echo "ll$n: DIFFERS"; status=1; fi
done
exit $status
