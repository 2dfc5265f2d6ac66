#!/usr/bin/env bash
# npm packages of the tokenizer / chat-template reference tests (tests/chat/js: @huggingface/tokenizers and
# @huggingface/jinja, pinned by its package-lock.json), installed into tests/chat/js/node_modules so ctest never
# fetches anything (the CTest fixture hf_reference fails with a message when they are missing). Called by
# scripts/install-deps.sh; a folder whose lock file is unchanged since its last install is skipped (works offline).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for dir in "$root/tests/chat/js"; do
  if [[ -d "$dir/node_modules" ]] && cmp -s "$dir/package-lock.json" "$dir/.installed-lock"; then continue; fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "install-npm-test-deps: npm is missing (install-deps.sh installs nodejs + npm)" >&2
    exit 1
  fi
  echo "install-npm-test-deps: npm ci in $dir"
  (cd "$dir" && npm ci --no-audit --no-fund --prefer-offline)
  cp "$dir/package-lock.json" "$dir/.installed-lock"
done
