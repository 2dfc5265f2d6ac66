#!/usr/bin/env bash
# Installs batchgen's build and test dependencies on Debian 12 (bookworm). Idempotent: when every package is already
# installed it does nothing (so it also works offline); otherwise apt-get update, then apt-get install -y. Then the
# tests' npm packages (scripts/install-npm.sh; skipped when already installed).
# Set BG_APT_ALWAYS=1 to run apt-get even when nothing is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache
  clang libclang-rt-14-dev          # libFuzzer + sanitizer runtimes for the fuzz build
  nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev
  libgtest-dev libgmock-dev libxxhash-dev
  libboost-dev                      # HTTP server (frontend): Boost.Beast + Asio, header-only
  libpcre2-dev                      # tokenizer pre-tokenizer regex
  libicu-dev                        # tokenizer.json normalizers (NFC/NFKC, lower-casing)
  libzmq3-dev cppzmq-dev            # frontend <-> worker IPC
  liburing-dev libnuma-dev libucx-dev libssl-dev  # weight store: io_uring loads, NUMA placement, peers + their HMAC
  curl git python3
)

missing=()
# Node.js + npm run the end-to-end API tests with the official openai npm client. A machine that already has node and
# npm (often from NodeSource, whose nodejs conflicts with Debian's npm package) keeps them.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  PACKAGES+=(nodejs npm)
fi
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

# The npm packages of the tests (scripts/install-npm.sh) come last, once node and npm are there.
install_npm() { "$(dirname "${BASH_SOURCE[0]}")/install-npm.sh"; }

if [[ ${#missing[@]} -eq 0 && "${BG_APT_ALWAYS:-0}" != 1 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  install_npm
  exit 0
fi

# Root (containers, CI) runs apt-get directly; anyone else goes through sudo.
as_root=()
if [[ "$(id -u)" -ne 0 ]]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install-deps: not root and sudo is not available; missing: ${missing[*]}" >&2
    exit 1
  fi
  as_root=(sudo)
fi

echo "install-deps: installing ${missing[*]:-${PACKAGES[*]}}"
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PACKAGES[@]}"
install_npm
