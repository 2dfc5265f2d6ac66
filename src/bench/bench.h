// `batchgen bench`: ceilings measured in the same run, then kernels, decode steps, prefill and the host side, each
// as a fraction of those ceilings (docs/PERF.md). This is the entry point the CLI calls.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "bench/bench_report.h"

namespace bg::bench {

struct BenchOptions {
  std::string what = "all";     // "kernels" | "step" | "prefill" | "all" | "exchange" (not part of "all")
  std::string device = "cuda";  // "cuda" | "cpu"
  bool quick = false;           // smaller sizes, fewer repeats (CI: seconds)
  bool deterministic = false;   // step / prefill with batch-invariant kernels (LoadOptions::deterministic)
  // Checkpoints for step / prefill / host. Empty: on the CPU, tiny Kimi-K3 and DeepSeek-V3 presets written by
  // make-random into a temporary directory; on CUDA an error (the slice is 13 GB: make it once, pass --model).
  std::vector<std::filesystem::path> models;
  // Empty: the defaults of the device and mode (docs/PERF.md).
  std::vector<int64_t> batches, contexts, prefill_tokens;
  int64_t prefill_chunk = 0;  // 0: the scheduler's default chunked_prefill_size
  int64_t decode_tokens = 0;  // greedy tokens generated after each prefill prompt (ids and margins reported)
  int replays = 0;            // timed decode steps per point; 0: 10 (quick: 3)
  std::string kernel_filter;  // only the kernel cases it matches (kernel_case_matches)
  // The weight source of the (one) --model: a weightd store to attach, peers to fetch from (docs/WEIGHTS.md).
  std::string weight_store;
  std::string distributed_weight_config;
  double resident_experts = 1.0;  // --resident-experts (LoadOptions::resident_experts)
  std::string expert_trace;       // --expert-trace
  // bench exchange (CUDA): rank counts and tokens per rank per call; empty: 2,4,8 and 1,16,128.
  std::vector<int64_t> exchange_ranks, exchange_tokens;
  std::string command;        // the command line, for the report
};

// Whether `--kernels FILTER` takes the case `name`: FILTER is a comma-separated list of entries, each matching the
// names that contain it, or, ending in '$', the one name equal to it without the '$'. An empty FILTER takes every
// case; an empty entry matches nothing.
bool kernel_case_matches(std::string_view name, std::string_view filter);

// Validates the options (a bg::Error naming the flag), runs the requested parts and returns the report. Progress
// goes to the log (stderr).
BenchReport run_bench(const BenchOptions& options);

}  // namespace bg::bench
