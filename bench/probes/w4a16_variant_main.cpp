// Harness for experiments on the W4A16 expert kernel: links one variant of moe_w4a16_cuda.cu (built by
// scripts/w4a16-variant-build.sh) with the rest of batchgen_lib and prints the K3 micro-benchmark table, so several
// variants run side by side on the GPU machine in one call (scripts/gpu-w4a16-variants.sh) without a test_cuda each.
#include <cstdio>
#include <cstdlib>

#include "ops/moe_w4a16/moe_w4a16_bench.h"

// Arguments, if any: the rows per expert to run (default: the bench's 1, 4, 16, 32). BG_W4A16_BENCH_TOUCHED: the
// experts every token picks (default 16; at most 32, the kernel's top-k bound). BG_W4A16_BENCH_RANDOM=1: the
// arguments are token counts, each token's experts a random top-k of the 56 (MoeW4a16BenchConfig::random_routing).
int main(int argc, char** argv) {
  bg::ops::MoeW4a16BenchConfig cfg;
  if (const char* t = std::getenv("BG_W4A16_BENCH_TOUCHED")) cfg.touched = std::atoi(t);
  if (const char* r = std::getenv("BG_W4A16_BENCH_RANDOM")) cfg.random_routing = std::atoi(r) != 0;
  if (argc > 1) cfg.rows_per_expert.clear();
  for (int i = 1; i < argc; ++i) cfg.rows_per_expert.push_back(std::atoi(argv[i]));
  const bg::ops::MoeW4a16BenchResult r = bg::ops::moe_w4a16_bench_k3(cfg);
  std::printf("%s", bg::ops::moe_w4a16_bench_table(r).c_str());
  return 0;
}
