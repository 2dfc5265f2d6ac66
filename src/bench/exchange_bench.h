// `batchgen bench exchange` (CUDA builds): the ll expert exchange's dispatch / combine latency and payload bandwidth
// between rank threads that share this process's GPU (docs/PERF.md, "Expert exchange"). A regression guard for the
// exchange's kernels; the figure that matters, between GPUs, needs several GPUs.
#pragma once

#include <cstdint>
#include <vector>

#include "bench/bench_report.h"

namespace bg::bench {

struct ExchangeBenchOptions {
  std::vector<int64_t> ranks{2, 4, 8};
  std::vector<int64_t> tokens{1, 16, 128};  // tokens each rank sends per call
  int64_t top_k = 16;
  int64_t hidden = 7168;
  int64_t experts_per_rank = 56;  // Kimi-K3 at EP16
  int warmup = 3;
  int calls = 20;
};

#ifdef BG_HAVE_CUDA
std::vector<ExchangeResult> run_exchange_bench(const ExchangeBenchOptions& options);
#endif

}  // namespace bg::bench
