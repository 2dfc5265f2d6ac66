#!/usr/bin/env bash
# Installs the npm packages the tests use, before the build, so that CTest never touches the network: `npm ci` from
# each folder's package-lock.json into <folder>/node_modules (git-ignored). Offline-friendly: a folder whose
# node_modules was installed from the same lock file is skipped, and npm prefers its cache (~/.npm); a failing
# `npm ci` (a registry hiccup) is retried with backoff. To add a folder, append it to NPM_FOLDERS.
# Called by scripts/install-deps.sh (and by scripts/test.sh when BG_SKIP_DEPS=1). BG_NPM_ATTEMPTS (default 4).
set -euo pipefail

NPM_FOLDERS=(
  tests/e2e            # the official openai client for the end-to-end API and reliability tests
  tests/tokenizer/js   # js-tiktoken, the tokenizer reference
  tests/chat/js        # @huggingface/tokenizers + @huggingface/jinja: tokenizer.json and chat-template references
)

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
attempts="${BG_NPM_ATTEMPTS:-4}"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "install-npm: node and npm are required (Node.js >= 20; scripts/install-deps.sh installs them)" >&2
  exit 1
fi

for folder in "${NPM_FOLDERS[@]}"; do
  dir="$root/$folder"
  if [[ ! -f "$dir/package.json" || ! -f "$dir/package-lock.json" ]]; then
    echo "install-npm: $folder has no package.json + package-lock.json" >&2
    exit 1
  fi
  want="$(cat "$dir/package.json" "$dir/package-lock.json" | sha256sum | cut -d' ' -f1)"
  stamp="$dir/node_modules/.batchgen-installed"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "install-npm: $folder is up to date"
    continue
  fi
  for ((i = 1; ; i++)); do
    echo "install-npm: npm ci in $folder (attempt $i of $attempts)"
    if (cd "$dir" && npm ci --no-audit --no-fund --prefer-offline --loglevel=error); then
      break
    fi
    if ((i >= attempts)); then
      echo "install-npm: npm ci failed $attempts times in $folder; the npm registry (or a cache holding the" \
           "packages of its package-lock.json) is needed once" >&2
      exit 1
    fi
    sleep $((5 * i))
  done
  echo "$want" >"$stamp"
done
