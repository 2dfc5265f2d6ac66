#!/usr/bin/env bash
# The step memory profile of a rank set on the H200: the ep16-rank slice served by 2 ranks sharing this GPU over the
# ll exchange (the profile is one collective; docs/SERVING_ENGINE.md, "Step reserve"), then by one rank, each ready
# with its plan logged; a 12,000-token prompt and a short one are answered by both, the short one's tokens compared.
#   scripts/gpu-rank-profile.sh [BUNDLE]
# Output: $OUT/rank-profile.txt (the summary), the serve logs beside it.
set -u
BUNDLE=${1:-.gpu}
OUT=${OUT:-$PWD/gpu-out}
MODEL=${BG_BENCH_MODEL:-/tmp/bg-ep16-rank}
source "$(dirname "$0")/gpu-bundle-env.sh"
SUMMARY="$OUT/rank-profile.txt"
: > "$SUMMARY"
ensure_slice "$MODEL"
run() {  # run NAME ARGS...: serve, wait for /ready, a long and a short completion, SIGTERM
  local name=$1 port=8450 t0=$SECONDS; shift
  "$BG" serve "$MODEL" --device cuda --port "$port" --served-model-name k3 --max-num-seqs 8 "$@" \
    > "$OUT/$name.log" 2>&1 &
  local server=$!
  if wait_ready "$port" "$server"; then
    echo "$name: ready after $((SECONDS - t0)) s" >> "$SUMMARY"
  else
    echo "$name: NOT READY" >> "$SUMMARY"; tail -5 "$OUT/$name.log" >> "$SUMMARY"
  fi
  grep -E "with the largest step measured|the set runs|worker rank [0-9]+: (cuda|plan)" "$OUT/$name.log" |
    sed 's/^.*\] //' >> "$SUMMARY"
  python3 - "$port" "$name" >> "$SUMMARY" <<'PY'
import json, sys, urllib.request
port, name = sys.argv[1], sys.argv[2]
def complete(prompt, n):
    body = json.dumps({"model": "k3", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.load(r)
    except Exception as e:
        return 0, str(e)
long_ids = [(i * 7919 + 11) % 150000 + 1000 for i in range(12000)]
s, r = complete(long_ids, 4)
print(f"{name}: 12000-token prompt -> {s} {r['usage'] if s == 200 else r}")
s, r = complete([(i * 31 + 7) % 150000 + 1000 for i in range(64)], 16)
print(f"{name}: short prompt -> {s} text {json.dumps(r['choices'][0]['text']) if s == 200 else r}")
PY
  kill -TERM "$server"; wait "$server"; echo "$name: exit $?" >> "$SUMMARY"
}
run ll2 --ep 2 --k3-moe-exchange ll
run one
cat "$SUMMARY"
