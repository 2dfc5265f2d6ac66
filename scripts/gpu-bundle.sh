#!/usr/bin/env bash
# Packs what a GPU machine needs into .gpu/ (ignored by git): the CUDA test binary and CLI from a CUDA build, the
# shared libraries they link (all but the C runtime and CUDA's), and a copy of the golden cases. Other builds' binaries
# waiting in .gpu/old for scripts/gpu-ab.sh are kept.
set -euo pipefail
BUILD=${1:-build}
keep_old() { if [[ -d .gpu/old ]]; then rm -rf .gpu-old && mv .gpu/old .gpu-old; fi; }
restore_old() { if [[ -d .gpu-old ]]; then mv .gpu-old .gpu/old; fi; }
keep_old
rm -rf .gpu && mkdir -p .gpu/lib
cp "$BUILD/tests/test_cuda" "$BUILD/batchgen" .gpu/
# Every shared library they link except the C runtime (which the GPU machine has) and CUDA's (from its toolkit).
for lib in $(ldd "$BUILD/batchgen" "$BUILD/tests/test_cuda" | awk '$3 ~ /^\// {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libresolv.so*|ld-linux*|libstdc++*|libgcc_s*) ;;
    libcublas*|libcudart*|libnccl*|libcudnn*) ;;  # CUDA's: the GPU machine has its own (NCCL and cuDNN from torch)
    *) cp -L "$lib" .gpu/lib/ ;;
  esac
done
cp -r ../shared/golden .gpu/golden
cp ../shared/tools/load.py .gpu/load.py  # the served-throughput clients (scripts/gpu-load-check.sh)
cp scripts/load_async.py .gpu/load_async.py
chmod -R u+w .gpu
# One xz archive keeps the carried tree under the device tool's 64 MiB (scripts/gpu-check.sh unpacks it there).
if [[ "${BG_BUNDLE_XZ:-1}" == 1 ]]; then
  (cd .gpu && tar -cf - test_cuda batchgen lib golden load.py load_async.py | xz -T2 -6 > ../.gpu-bundle.tar.xz)
  rm -rf .gpu && mkdir -p .gpu && mv .gpu-bundle.tar.xz .gpu/bundle.tar.xz
fi
restore_old
du -sh .gpu
