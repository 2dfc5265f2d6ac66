#!/usr/bin/env bash
# Packs what a GPU machine needs into .gpu/ (ignored by git): the CUDA test binary and CLI from a CUDA build, the
# Debian-only shared libraries they link (spdlog, fmt), and a copy of the golden cases.
set -euo pipefail
BUILD=${1:-build}
rm -rf .gpu && mkdir -p .gpu/lib
cp "$BUILD/tests/test_cuda" "$BUILD/batchgen" .gpu/
for lib in $(ldd "$BUILD/batchgen" "$BUILD/tests/test_cuda" | awk '/spdlog|fmt/ {print $3}' | sort -u); do
  cp -L "$lib" .gpu/lib/
done
cp -r ../shared/golden .gpu/golden
chmod -R u+w .gpu
du -sh .gpu
