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
  std::optional<int64_t> max_queue;
  std::string api_key;
  std::string served_model_name;                // "": the model directory's name
  std::string k3_moe_exchange = "nccl";         // nccl | ll: the expert exchange between CUDA ranks
  int64_t moe_exchange_tokens = 0;              // tokens per rank per exchange call (0: the exchange's default)
  dist::ParallelFlags parallel;                 // --tp / --dp / --ep / --nnodes / --node-rank
  std::string dist_init_addr;                   // host:port of node 0's rendezvous (several nodes)
  std::string distributed_weight_config;        // path; not supported yet
  size_t max_body_bytes = size_t{16} << 20;
  size_t n_http_threads = 64;
};

// Checks every option; fills served_model_name. Throws bg::Error with a message for the user.
void validate_serve_options(ServeOptions& opt);

// The `batchgen worker` command line for one rank (argv[0] = exe); with several ranks it carries the layout and the
// rendezvous endpoint.
std::vector<std::string> worker_command(const ServeOptions& opt, const std::string& exe, const std::string& endpoint,
                                        int32_t rank, const std::string& rendezvous = "");

// Runs until SIGINT/SIGTERM; returns the process exit code.
int run_serve(ServeOptions opt);

}  // namespace bg::frontend
