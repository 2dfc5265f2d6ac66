// Harness for experiments on the W4A16 expert kernel: links one variant of moe_w4a16_cuda.cu (built by
// scripts/w4a16-variant-build.sh) with the rest of batchgen_lib and prints the K3 micro-benchmark table, so several
// variants run side by side on the GPU machine in one call (scripts/gpu-w4a16-variants.sh) without a test_cuda each.
#include <cstdio>

#include "ops/moe_w4a16/moe_w4a16_bench.h"

int main() {
  const bg::ops::MoeW4a16BenchResult r = bg::ops::moe_w4a16_bench_k3({});
  std::printf("%s", bg::ops::moe_w4a16_bench_table(r).c_str());
  return 0;
}
