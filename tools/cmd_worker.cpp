// `batchgen worker`: one rank's engine process, started by the frontend (fork/exec) and driven over ZeroMQ
// (src/server/protocol.h). Flags follow vLLM/SGLang names; docs/SERVING_ENGINE.md describes them.
#include <cstdlib>

#include "core/error.h"
#include "engine/worker.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/parallel_cli.h"

namespace bg::tools {

void register_worker(CLI::App& app) {
  auto o = std::make_shared<engine::WorkerOptions>();
  o->exit_process_on_stop_while_loading = true;
  auto* cmd = app.add_subcommand("worker", "Run one rank's engine for a frontend (normally started by `serve`)");
  cmd->add_option("--model", o->model_dir, "Checkpoint directory")->required();
  cmd->add_option("--endpoint", o->endpoint, "The frontend's ZeroMQ ROUTER endpoint (ipc://..., tcp://...)")
      ->required();
  cmd->add_option("--rank", o->rank, "This worker's rank (default 0)");
  cmd->add_option("--routing-id", o->routing_id, "The ZeroMQ routing id the frontend expects from this process "
                  "(default rank-<r>)");
  cmd->add_option("--device", o->device, "Backend: cpu (fp32 reference) or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--max-num-seqs", o->max_num_seqs,
                  "Most sequences running at once (default 16 on cpu, 256 on cuda; lowered to what memory holds)");
  cmd->add_option("--max-model-len", o->max_model_len,
                  "Prompt + completion tokens per request (default: the model's context capped by memory)");
  cmd->add_option("--chunked-prefill-size", o->chunked_prefill_size,
                  "Tokens per step: decodes first, then prefill chunks (default 2048)");
  cmd->add_option("--idle-prefill-size", o->idle_prefill_size,
                  "Tokens per step when no running sequence decodes in it (a lone or queued prompt prefills in these "
                  "larger steps; a step with decodes keeps --chunked-prefill-size). Default 8192 on cuda, off on cpu; "
                  "0: off; ignored with --deterministic");
  cmd->add_option("--max-queue", o->max_queue, "Requests waiting beyond the free running places before new ones are "
                  "rejected with 503 (default 1024; 0: only what can start now)");
  cmd->add_option("--kv-block-size", o->kv_block_size, "Tokens per KV cache block (default 64)");
  cmd->add_option("--kv-cache-memory-bytes", o->kv_cache_memory_bytes,
                  "Bytes for the KV cache + sequence state (default: cpu min(2 GiB, RAM/4); cuda from "
                  "--gpu-memory-utilization)");
  cmd->add_option("--gpu-memory-utilization", o->gpu_memory_utilization,
                  "cuda: fraction of free GPU memory for weights + KV cache + state (default 0.9)");
  add_weight_source_options(cmd, o->weight_store, o->distributed_weight_config);
  add_expert_residency_options(cmd, o->resident_experts, o->expert_trace);
  cmd->add_flag("--no-prefix-cache", [o](int64_t) { o->prefix_cache = false; },
               "Do not reuse KV / state of earlier requests that share a prefix (default: on)");
  cmd->add_flag("--no-step-profile", [o](int64_t) { o->profile_memory = false; },
               "cuda: size the KV cache without first measuring the largest prefill step's memory (default: measured "
               "and kept out of the --gpu-memory-utilization budget)");
  cmd->add_flag("--no-warmup", [o](int64_t) { o->warmup = false; },
               "cuda: report ready without running dummy requests first (default: a prefill and every decode graph "
               "bucket are run before ready)");
  cmd->add_flag("--deterministic", o->deterministic, "Batch-invariant results: fixed kernel choices and prefill "
               "cut points whatever else runs (docs/DETERMINISM.md)");
  cmd->add_option("--prefix-snapshot-interval", o->snapshot_interval, "Tokens between KDA state snapshots in the "
                  "prefix cache; a multiple of the KV block size and 64 (default 512)");
  cmd->add_option("--host-memory-gb", o->host_memory_gb, "Host memory (GiB, pinned on cuda) for offloaded sequences "
                  "and prefix-cache entries (default 0: no host tier)");
  cmd->add_option("--state-offload-dtype", o->state_offload_dtype, "How offloaded KDA state is stored: f32 (exact, "
                  "default), bf16 or fp8 (per-row scales; lossy)")->check(CLI::IsMember({"f32", "bf16", "fp8"}));
  cmd->add_option("--swap-quantum-steps", o->swap_quantum_steps, "With a host tier: steps a request runs before it "
                  "gives its GPU place to a waiting one (time slicing; default 0: never)");
  cmd->add_option("--parent-pid", o->parent_pid, "Exit when this process (the frontend) is gone (default: never)");
  auto par = std::make_shared<ParallelArgs>();
  add_parallel_flags(cmd, *par, true);
  cmd->add_option("--rendezvous", o->rendezvous, "The rank set's rendezvous endpoint (several ranks)");
  cmd->callback([o, par] {
    o->parallel = par->flags();
    o->moe_exchange = par->exchange;
    o->node_secret_file = par->node_secret_file;
    o->moe_exchange_tokens = par->max_tokens_per_call;
    const int code = engine::run_worker(*o);
    if (code != 0) std::exit(code);
  });
}

}  // namespace bg::tools
