#!/usr/bin/env bash
# The README's main job: install dependencies, build the CPU engine, create the embedded default model (a random-weight
# Kimi-K3 checkpoint in the real published layout) and run it: greedy generation, then a scored prompt.
# Environment: BG_SKIP_DEPS=1 skips the apt step; BG_DEMO_DIR (default build-demo/) holds build and model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dir="${BG_DEMO_DIR:-build-demo}"
if [[ "${BG_SKIP_DEPS:-0}" != 1 ]]; then scripts/install-deps.sh; fi
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBG_CUDA=OFF -DBG_TESTS=OFF
cmake --build "$dir" --parallel "$(nproc)" --target batchgen
model="$dir/k3-tiny"
if [[ ! -f "$model/config.json" ]]; then
  "$dir/batchgen" make-random --arch kimi_k3 --preset tiny --seed 1 --out "$model"
fi
echo "== generate (greedy, 16 tokens) from prompt ids 1,2,3,4,5 on $model"
"$dir/batchgen" generate --model "$model" --prompt-ids 1,2,3,4,5 --max-tokens 16
echo "== score: prefill 6 tokens, then 4 decode steps; logits -> $dir/logits.safetensors"
"$dir/batchgen" score --model "$model" --tokens 1,2,3,4,5,6,7,8,9,10 --prefill 6 --out "$dir/logits.safetensors"
