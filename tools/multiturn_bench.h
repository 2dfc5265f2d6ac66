// `batchgen bench-multiturn`: the state manager's benchmark, in process over the real engine (planner, scheduler,
// state manager, model). Part 1: conversations x turns sharing a system prompt, each turn submitted when the previous
// one finishes, with the prefix cache off and on: TTFT and prefill tokens computed vs saved, and whether the outputs
// are identical. Part 2: at the same KV budget, many long-running requests without and with the host tier (time
// slicing): requests in flight at once and decode throughput. docs/SERVING_ENGINE.md, "Benchmarks".
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

namespace bg::tools {

struct MultiturnOptions {
  std::filesystem::path model_dir;
  std::string device = "cpu";
  // part 1
  int64_t conversations = 32;
  int64_t turns = 8;
  int64_t system_tokens = 4096;
  int64_t user_tokens = 64;            // new tokens per turn
  int64_t reply_tokens = 32;           // generated per turn (ignore_eos)
  // part 2 (0 requests: skipped)
  int64_t concurrency_requests = 0;
  int64_t concurrency_prompt = 256;
  int64_t concurrency_tokens = 64;
  int64_t swap_quantum_steps = 8;
  // engine
  int64_t max_num_seqs = 0;
  int64_t max_model_len = 0;
  int64_t chunked_prefill_size = 512;
  int64_t kv_block_size = 64;
  int64_t kv_cache_memory_bytes = 0;
  double gpu_memory_utilization = 0.9;
  int64_t snapshot_interval = 0;
  double host_memory_gb = 0.0;         // part 1 runs with it too when > 0
  bool deterministic = false;          // batch-invariant kernels and prefill cut points (as serve --deterministic)
  uint64_t seed = 1;
};

// Runs both parts, logs a table per part and returns the report (also what --json writes).
nlohmann::json run_multiturn_bench(const MultiturnOptions& options);

}  // namespace bg::tools
