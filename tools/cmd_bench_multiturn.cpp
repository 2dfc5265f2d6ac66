// `batchgen bench-multiturn`: the prefix cache and host tier benchmark (tools/multiturn_bench.h).
#include <fstream>
#include <iostream>

#include "core/error.h"
#include "tools/commands.h"
#include "tools/multiturn_bench.h"

namespace bg::tools {

void register_bench_multiturn(CLI::App& app) {
  auto o = std::make_shared<MultiturnOptions>();
  auto json_path = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand("bench-multiturn", "Multi-turn conversations with the prefix cache off and on (TTFT, "
                                 "prefill saved), and requests in flight with and without the host tier");
  cmd->add_option("--model", o->model_dir, "Checkpoint directory")->required()->check(CLI::ExistingDirectory);
  cmd->add_option("--device", o->device, "cpu (default) or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--conversations", o->conversations, "Conversations (default 32)");
  cmd->add_option("--turns", o->turns, "Turns per conversation (default 8)");
  cmd->add_option("--system-tokens", o->system_tokens, "Shared system prompt length (default 4096)");
  cmd->add_option("--user-tokens", o->user_tokens, "New tokens per turn (default 64)");
  cmd->add_option("--reply-tokens", o->reply_tokens, "Tokens generated per turn (default 32)");
  cmd->add_option("--concurrency-requests", o->concurrency_requests, "Part 2: requests submitted at once, run without "
                  "and with the host tier (default 0: skip)");
  cmd->add_option("--concurrency-prompt", o->concurrency_prompt, "Part 2 prompt length (default 256)");
  cmd->add_option("--concurrency-tokens", o->concurrency_tokens, "Part 2 tokens generated each (default 64)");
  cmd->add_option("--swap-quantum-steps", o->swap_quantum_steps, "Part 2 with the host tier: steps per turn on the "
                  "GPU (default 8)");
  cmd->add_option("--max-num-seqs", o->max_num_seqs, "As for the worker (default: the planner's)");
  cmd->add_option("--max-model-len", o->max_model_len, "As for the worker (default: the model's context capped by "
                  "memory; give it so state slots are left for many sequences)");
  cmd->add_option("--chunked-prefill-size", o->chunked_prefill_size, "Tokens per step (default 512)");
  cmd->add_option("--kv-block-size", o->kv_block_size, "Tokens per KV block (default 64)");
  cmd->add_option("--kv-cache-memory-bytes", o->kv_cache_memory_bytes, "KV + state budget, the same in every run");
  cmd->add_option("--gpu-memory-utilization", o->gpu_memory_utilization, "cuda, without --kv-cache-memory-bytes");
  cmd->add_option("--prefix-snapshot-interval", o->snapshot_interval, "Tokens between KDA snapshots (default 512)");
  cmd->add_option("--host-memory-gb", o->host_memory_gb, "Host tier (part 1 uses it too; part 2 needs it)");
  cmd->add_flag("--deterministic", o->deterministic, "Batch-invariant kernels and prefill cut points (as serve "
               "--deterministic): the outputs with the cache on and off must then be identical on the GPU too");
  cmd->add_option("--seed", o->seed, "Token ids of the prompts (default 1)");
  cmd->add_option("--json", *json_path, "Write the report as JSON to this file");
  cmd->callback([o, json_path] {
    const nlohmann::json report = run_multiturn_bench(*o);
    if (json_path->empty()) {
      std::cout << report.dump(2) << "\n";
      return;
    }
    std::ofstream out(*json_path);
    out << report.dump(2) << "\n";
    BG_CHECK(out.good(), "--json: writing '{}' failed", *json_path);
  });
}

}  // namespace bg::tools
