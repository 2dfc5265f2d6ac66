#!/usr/bin/env bash
# Builds a W4A16 kernel experiment: scripts/w4a16-variant-build.sh NAME VARIANT.cu
# VARIANT.cu is a copy of src/ops/moe_w4a16/moe_w4a16_cuda.cu with the change under test (includes resolve against
# src/). It is compiled with build-cuda's exact flags (ptxas report printed) and linked with
# bench/probes/w4a16_variant_main.cpp and build-cuda's batchgen_lib into .gpu/var/NAME (about 2 MB), which
# scripts/gpu-w4a16-variants.sh runs on the GPU machine. Needs a configured and built build-cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=$1
SRC=$(realpath "$2")
TMP=build-cuda/w4a16-variants
mkdir -p "$TMP" .gpu/var
CMD=$(ninja -C build-cuda -t commands batchgen_lib | grep -m1 "moe_w4a16_cuda.cu")
NVCC=$(echo "$CMD" | sed -e 's|.*/usr/bin/ccache ||' -e 's| -MD -MT [^ ]* -MF [^ ]*||' -e 's| -lineinfo||' \
  -e "s| -o [^ ]*\.o| -o $PWD/$TMP/$NAME.o|" -e "s| -c [^ ]*moe_w4a16_cuda.cu| -c $SRC|")
eval "$NVCC -Xptxas -v" 2>&1 | grep -E "error|Used"
c++ -O2 -std=c++20 -DBG_HAVE_CUDA=1 -DFMT_SHARED -Isrc -Iinclude -I/usr/local/cuda/include \
  -c bench/probes/w4a16_variant_main.cpp -o "$TMP/main.o"
LIBS=$(ninja -C build-cuda -t commands test_cuda | grep -m1 "o tests/test_cuda " \
  | sed -e 's/^.*-o tests\/test_cuda //' -e 's/ && cd .*//' | tr ' ' '\n' | grep -v gtest | tr '\n' ' ')
(cd build-cuda && c++ -O2 -o "../.gpu/var/$NAME" "../$TMP/main.o" "../$TMP/$NAME.o" $LIBS)
strip ".gpu/var/$NAME"
ls -la ".gpu/var/$NAME"
