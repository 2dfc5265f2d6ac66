#!/usr/bin/env bash
# The README's main job: install dependencies, build the CPU engine, create the embedded default model (a random-weight
# Kimi-K3 checkpoint in the real published layout, with its tokenizer files) and serve it with the OpenAI-compatible
# server on 127.0.0.1. Once the server is ready it sends one chat completion with curl, prints the answer, and keeps
# serving until Ctrl-C.
# Environment: BG_SKIP_DEPS=1 skips the apt step; BG_DEMO_DIR (default build-demo/) holds build and model;
# BG_PORT (default 8000); BG_DEMO_ONESHOT=1 stops the server after the sample request (for scripted checks).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dir="${BG_DEMO_DIR:-build-demo}"
port="${BG_PORT:-8000}"
if [[ "${BG_SKIP_DEPS:-0}" != 1 ]]; then scripts/install-deps.sh; fi
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBG_CUDA=OFF -DBG_TESTS=OFF
cmake --build "$dir" --parallel "$(nproc)" --target batchgen
model="$dir/k3-tiny"
if [[ ! -f "$model/tiktoken.model" ]]; then
  rm -rf "$model"
  "$dir/batchgen" make-random --arch kimi_k3 --preset tiny --seed 1 --out "$model"
fi

echo "== serving $model as 'k3-tiny' on http://127.0.0.1:$port (OpenAI API under /v1)"
"$dir/batchgen" serve "$model" --port "$port" --served-model-name k3-tiny &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 240); do
  if curl -sf "http://127.0.0.1:$port/ready" >/dev/null; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then echo "demo: the server exited during startup" >&2; exit 1; fi
  sleep 0.5
done
curl -sf "http://127.0.0.1:$port/ready" >/dev/null || { echo "demo: the server did not become ready" >&2; exit 1; }

request='{"model": "k3-tiny", "messages": [{"role": "user", "content": "Hello! Who are you?"}],
          "max_tokens": 24, "temperature": 0}'
echo "== curl http://127.0.0.1:$port/v1/chat/completions -d '$(tr -s ' \n' ' ' <<<"$request")'"
response="$(curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$request")"
echo "$response"
# The two channels of the answer, each named: Kimi-K3 reasons first (reasoning_content), then answers (content).
python3 - "$response" <<'PY'
import json, sys
msg = json.loads(sys.argv[1])["choices"][0]["message"]
finish = json.loads(sys.argv[1])["choices"][0]["finish_reason"]
print("== reasoning (message.reasoning_content):", repr(msg.get("reasoning_content") or ""))
print("== answer (message.content):", repr(msg.get("content") or ""))
if not msg.get("content"):
    print("== the answer is empty: generation ended (finish_reason=%s) while the model was still in its reasoning "
          "channel; raise max_tokens, or send \"reasoning_effort\": \"none\" to skip reasoning" % finish)
PY
echo "== (random weights: the text is noise; the protocol, tokenizer and engine are real)"
if [[ "${BG_DEMO_ONESHOT:-0}" == 1 ]]; then exit 0; fi
echo "== the server keeps running; try the curl commands in docs/SERVING.md. Ctrl-C stops it."
wait "$server"
