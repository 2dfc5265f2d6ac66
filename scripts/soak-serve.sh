#!/usr/bin/env bash
# A soak of `batchgen serve` on CPU (manual; docs/SERVING.md records the last run): a tiny random Kimi-K3 checkpoint,
# STREAMS concurrent clients for MINUTES (streamed and non-streamed chat and completions, some hanging up on
# purpose), RSS of both processes sampled every 30 s, and at the end, idle, every KV block and state slot free.
#   scripts/soak-serve.sh [MINUTES=30] [STREAMS=256]
# Needs build/batchgen (or BATCHGEN=path) and the npm packages of tests/e2e (scripts/install-npm.sh). Prints a
# Markdown table; exits 1 on any request error, RSS growth, a leaked block/slot or a worker restart.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
minutes="${1:-30}"
streams="${2:-256}"
bin="${BATCHGEN:-$root/build/batchgen}"
work="$(mktemp -d)"
serve_pid=""
cleanup() {
  if [[ -n "$serve_pid" ]] && kill -0 "$serve_pid" 2>/dev/null; then
    kill -TERM "$serve_pid"
    wait "$serve_pid" || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

"$bin" make-random --arch kimi_k3 --preset tiny --out "$work/soak" >/dev/null 2>&1
"$bin" serve "$work/soak" --port 0 --max-num-seqs 256 --max-model-len 1024 --max-connections 2048 \
  2>"$work/serve.log" &
serve_pid=$!
port=""
for _ in $(seq 300); do
  port="$(grep -oE 'listening on http://[0-9.]+:[0-9]+' "$work/serve.log" | grep -oE '[0-9]+$' || true)"
  if [[ -n "$port" ]] && curl -sf "http://127.0.0.1:$port/ready" >/dev/null; then break; fi
  sleep 0.2
done
curl -sf "http://127.0.0.1:$port/ready" >/dev/null || { cat "$work/serve.log" >&2; exit 1; }
echo "soak: serve pid $serve_pid on port $port; $streams clients for $minutes min" >&2
node "$root/tests/e2e/soak.mjs" "http://127.0.0.1:$port" "$serve_pid" "$minutes" "$streams"
