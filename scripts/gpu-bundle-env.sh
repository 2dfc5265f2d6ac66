# Sourced by the GPU-machine scripts that run a carried bundle (scripts/gpu-bundle.sh): with BUNDLE and OUT set,
# unpacks the bundle once, puts its libraries and torch's CUDA ones on the library path, and sets BG to its batchgen.
#   ensure_slice DIR       writes the K3 ep16-rank slice into DIR unless it is there (log in $OUT)
#   wait_ready PORT PID    waits up to 240 s for /ready on PORT while process PID lives; status 0 when ready
#   gtest_summary NAME LOG RC   appends to $S a googletest run's result line and its first failures
#   has PART               whether PART is one of the words of $PARTS (the scripts' part selection)
#   W4A16_TESTS            the gtest filter of the W4A16 kernel's parity tests and every GPU path that runs it
#   dump_sass BIN NAME [RE]  the SASS of BIN's kernels whose names match RE (default prefill_kernel), from cuobjdump,
#                          xz'd into $OUT/NAME.sass.xz, and a line in $S counting its wgmma issues, waits, barriers
#   script_start           a measuring script's start: S (the summary), T (test_cuda), T0, `at NAME` (a timestamp
#                          line in $S), the GPU's name and clocks in $S, and the slice written in the background (its
#                          pid in SLICE) when PARTS has `step`
mkdir -p "$OUT"
if [[ -f $BUNDLE/bundle.tar.xz && ! -x $BUNDLE/batchgen ]]; then tar -C "$BUNDLE" -xJf "$BUNDLE/bundle.tar.xz"; fi
SP=/opt/torch/.venv/lib/python3.12/site-packages
export LD_LIBRARY_PATH="$BUNDLE/lib:$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:$SP/nvidia/cudnn/lib:${LD_LIBRARY_PATH:-}"
BG="$BUNDLE/batchgen"
ensure_slice() {
  if [[ ! -f "$1/model.safetensors.index.json" ]]; then
    "$BG" make-random --arch kimi_k3 --preset ep16-rank --out "$1" --force 2> "$OUT/make-random-ep16.log"
  fi
}
wait_ready() {
  for _ in $(seq 1 480); do
    curl -sf "http://127.0.0.1:$1/ready" > /dev/null && return 0
    kill -0 "$2" 2> /dev/null || return 1
    sleep 0.5
  done
  return 1
}
gtest_summary() {
  echo "$1 rc=$3: $(grep -E '^\[  (PASSED|FAILED) ' "$2" | tr '\n' ' ')" >> "$S"
  grep -E '^\[  FAILED  \]|Failure|error:|what\(\)|C\+\+ exception' "$2" | head -20 >> "$S"
}
has() { [[ " ${PARTS:-} " == *" $1 "* ]]; }
W4A16_TESTS='MoeW4a16*:MoeCudaParity.*:CudaExpertSlots.*:Cases/GoldenGpu.*:Models/StepGpu.*:Archs/*:'\
'Cases/StreamedExpertsGpu.*:BackendDiff*:GraphCapture*'
script_start() {
  S=$OUT/summary.txt
  T=$BUNDLE/test_cuda
  T0=$SECONDS
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$S"
  if has step; then ensure_slice /tmp/bg-ep16-rank & SLICE=$!; fi
}
dump_sass() {
  local co counts="" op
  co=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2> /dev/null | head -1)
  timeout 120 "$co" -sass "$1" 2> /dev/null | awk -v re="${3:-prefill_kernel}" '/Function : / {p = ($0 ~ re)} p' \
    > "$OUT/$2.sass"
  for op in HGMMA WARPGROUP.DEPBAR WARPGROUP.ARRIVE BAR.SYNC LDGSTS; do
    counts+=" $op $(grep -c "$op" "$OUT/$2.sass")"
  done
  echo "sass $2 ($co): $(wc -l < "$OUT/$2.sass") lines;$counts" >> "$S"
  xz -f "$OUT/$2.sass"
}
at() { echo "$1 at $((SECONDS - T0)) s" >> "$S"; }
