// `batchgen serve`: options, their validation, and the frontend process's lifecycle (text model, worker link,
// worker processes, HTTP server, signal handling and clean shutdown).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dist/parallel_layout.h"

namespace bg::frontend {

struct ServeOptions {
  std::string model_dir;
  std::string chat_template;  // a Jinja file replacing the checkpoint's chat template ("": the checkpoint's)
  std::string host = "127.0.0.1";
  int port = 8000;                              // 0: any free port (logged)
  std::string device = "cpu";                   // cpu | cuda
  std::optional<int64_t> max_num_seqs;          // unset: the worker's default
  std::optional<int64_t> max_model_len;
  std::optional<int64_t> chunked_prefill_size;
  std::optional<int64_t> idle_prefill_size;     // unset: the worker's default; 0: off
  std::optional<int64_t> max_queue;
  // Sequence state (the worker's kv::StateManager; docs/SERVING_ENGINE.md)
  bool prefix_cache = true;                     // false: --no-prefix-cache
  bool warmup = true;                           // false: --no-warmup
  bool profile_memory = true;                   // false: --no-step-profile
  std::optional<int64_t> prefix_snapshot_interval;
  std::optional<double> host_memory_gb;
  std::string state_offload_dtype;              // "": the worker's (f32)
  std::optional<int64_t> swap_quantum_steps;
  bool deterministic = false;                   // --deterministic: batch-invariant results (docs/DETERMINISM.md)
  std::string api_key;
  std::string served_model_name;                // "": the model directory's name
  std::string k3_moe_exchange = "nccl";         // nccl | ll: the expert exchange between CUDA ranks
  int64_t moe_exchange_tokens = 0;              // tokens per rank per exchange call (0: the exchange's default)
  dist::ParallelFlags parallel;                 // --tp / --dp / --ep, --nnodes / --node-rank (docs/PARALLEL.md)
  std::string dist_init_addr;                   // --dist-init-addr HOST:PORT of node 0 (several nodes)
  std::string node_secret_file;                 // --node-secret-file: authenticates the links between nodes
  double node_timeout_s = 10.0;                 // --node-timeout: a node agent (or node 0) silent this long is gone
  std::string distributed_weight_config;        // path (docs/WEIGHTS.md), passed to the workers
  std::string weight_store = "";                // weightd store the workers attach to ("" = read the files)
  double resident_experts = 1.0;                // --resident-experts, passed to the workers
  std::string expert_trace = "";                // --expert-trace, passed to the workers
  size_t max_body_bytes = size_t{16} << 20;
  // HTTP
  std::optional<int64_t> max_connections;       // unset: 4096, lowered to what the file-descriptor limit allows
  double header_timeout_s = 10.0;
  double keep_alive_timeout_s = 5.0;
  std::vector<std::string> allowed_hosts;       // empty: any Host header
  bool strict_params = false;
  // lifecycle and supervision
  double shutdown_timeout_s = 30.0;             // SIGTERM: in-flight requests get this long to finish
  double worker_heartbeat_timeout_s = 60.0;
  int64_t max_worker_restarts = 5;
};

// Checks every option; fills served_model_name. Throws bg::Error with a message for the user.
void validate_serve_options(ServeOptions& opt);

// The `batchgen worker` command line for one rank's process with routing id `identity` (argv[0] = exe); with several
// ranks it carries the layout (and the rank's node) and the rank set's rendezvous endpoint. The parent pid it names
// is this process's: the frontend's, or on another node its agent's.
std::vector<std::string> worker_command(const ServeOptions& opt, const std::string& exe, const std::string& endpoint,
                                        int32_t rank, const std::string& identity, const std::string& rendezvous = "");

// What every node of a serve that spans hosts must agree on (the layout and the options that shape a rank); a node
// agent started with another is refused.
std::string node_config_signature(const ServeOptions& opt);

// Runs until SIGINT/SIGTERM (then drains: stops accepting, lets in-flight requests finish up to the shutdown
// timeout) or until the worker set fails before it was ever ready; returns the process exit code (0 after a
// signal, 1 with the worker's error logged when it failed to start). With --nnodes > 1, node 0 serves HTTP and
// supervises every node's ranks; --node-rank K > 0 runs the node agent instead (node_agent.h).
int run_serve(ServeOptions opt);

}  // namespace bg::frontend
