// The worker process of one rank: connects a ZeroMQ DEALER ("rank-<r>") to the frontend's ROUTER, reports
// "loading", plans memory and loads the model on a helper thread, reports "ready" (or "failed"), then alternates
// polling messages and engine steps until "shutdown" or the frontend process dies. Protocol: server/protocol.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include <zmq.hpp>

#include "dist/parallel_layout.h"
#include "engine/engine.h"

namespace bg::engine {

struct WorkerOptions {
  std::filesystem::path model_dir;        // --model
  std::string endpoint;                   // --endpoint: the frontend's ROUTER (ipc://..., tcp://..., inproc://...)
  int32_t rank = 0;                       // --rank
  std::string routing_id;                 // --routing-id: the DEALER's id, matched exactly by the frontend
                                          // ("": rank-<r>)
  std::string device = "cpu";             // --device cpu|cuda
  int64_t max_num_seqs = 0;               // --max-num-seqs (0: planner default, 16 on cpu, 256 on cuda)
  int64_t max_model_len = 0;              // --max-model-len (0: the model's context capped by memory)
  int64_t chunked_prefill_size = 2048;    // --chunked-prefill-size: tokens per step
  int64_t idle_prefill_size = -1;         // --idle-prefill-size: tokens per step without decodes (-1: the device's
                                          // default, idle_prefill_default; 0: chunked_prefill_size)
  int64_t max_queue = 1024;               // --max-queue: waiting requests (beyond free running places) before 503
  int64_t kv_block_size = 64;             // --kv-block-size: tokens per KV block
  int64_t kv_cache_memory_bytes = 0;      // --kv-cache-memory-bytes (0: from the device's memory)
  double gpu_memory_utilization = 0.9;    // --gpu-memory-utilization
  bool prefix_cache = true;               // --no-prefix-cache turns it off
  bool warmup = true;                     // --no-warmup: no dummy requests before "ready" (cuda, one rank)
  bool profile_memory = true;             // --no-step-profile: no measured step before the KV cache is sized (cuda,
                                          // budget from --gpu-memory-utilization; a rank set measures together)
  int64_t snapshot_interval = 0;          // --prefix-snapshot-interval (0: the planner's default)
  bool deterministic = false;             // --deterministic: batch-invariant kernels and prefill cut points
  double host_memory_gb = 0.0;            // --host-memory-gb: the host tier (0: none)
  std::string state_offload_dtype = "f32";  // --state-offload-dtype f32|bf16|fp8
  int64_t swap_quantum_steps = 0;         // --swap-quantum-steps (needs the host tier)
  int64_t parent_pid = 0;                 // --parent-pid: exit when this process is gone (0: never)
  int64_t status_interval_ms = 1000;      // a status (the frontend's heartbeat) at least this often, between steps
  int64_t idle_poll_ms = 100;             // longest wait for a message while idle
  zmq::context_t* context = nullptr;      // inproc endpoints need the frontend's context (tests); null: own
  bool exit_process_on_stop_while_loading = false;  // the CLI: _exit at once instead of waiting for the load
  // Several ranks (docs/PARALLEL.md): the layout (--tp/--dp/--ep/--nnodes), the rendezvous to join, the expert
  // exchange between CUDA ranks and its tokens per call.
  dist::ParallelFlags parallel;
  std::string rendezvous;                 // --rendezvous (required with several ranks)
  std::string node_secret_file;           // --node-secret-file: the worker link and the rendezvous use its key
  std::string moe_exchange = "nccl";      // --k3-moe-exchange
  int64_t moe_exchange_tokens = 0;        // --moe-exchange-tokens (0: the exchange's default)
  int64_t multi_rank_idle_poll_ms = 5;    // longest wait for a message between step agreements when idle
  std::string weight_store = "";          // --weight-store: attach to this weightd store
  std::string distributed_weight_config = "";  // --distributed-weight-config
  double resident_experts = 1.0;          // --resident-experts (LoadOptions::resident_experts)
  std::string expert_trace = "";          // --expert-trace
};

// Flag checks (the planner and scheduler check the rest); throws bg::Error naming the flag.
void validate_worker_options(const WorkerOptions& options);

// Plans memory, joins the rank set (several ranks), loads the model and builds the engine (what the loading thread
// runs). on_phase (may be null) hears "joining" / "loading"; abandon (may be null) stops a join that waits for
// ranks that will not come. Throws bg::Error.
std::unique_ptr<Engine> load_engine(const WorkerOptions& options,
                                    const std::function<void(const std::string&)>& on_phase = {},
                                    const std::function<bool()>& abandon = {});

// Runs the worker to the end: 0 after "shutdown" or the parent's exit, 1 when loading failed (after reporting
// phase "failed" with the error). Throws only when the endpoint cannot be connected.
// --idle-prefill-size's default: 8192 on cuda (a prefill step of 8192 tokens runs about 2.5x the tokens/s of 2048 on
// the H200; bench/RESULTS.md), off on cpu, never below chunked_prefill_size.
int64_t idle_prefill_default(const std::string& device, int64_t chunked_prefill_size);

int run_worker(const WorkerOptions& options);

}  // namespace bg::engine
