// `batchgen serve <model-dir>`: the OpenAI-compatible HTTP frontend plus its worker process (flags in vLLM/SGLang
// conventions); the lifecycle lives in src/server/frontend/serve.cpp.
#include <memory>

#include "server/frontend/serve.h"
#include "tools/commands.h"
#include "tools/parallel_cli.h"

namespace bg::tools {
namespace {

// CLI11 fills plain integers; -1 stands for "not given" (the worker's default).
struct ServeArgs {
  frontend::ServeOptions opt;
  ParallelArgs par;
  int64_t max_num_seqs = -1;
  int64_t max_model_len = -1;
  int64_t chunked_prefill_size = -1;
  int64_t max_queue = -1;
};

std::optional<int64_t> given(int64_t v) { return v == -1 ? std::nullopt : std::optional<int64_t>(v); }

}  // namespace

void register_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  frontend::ServeOptions& o = a->opt;
  auto* cmd = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API");
  cmd->add_option("model", o.model_dir, "Model directory (config.json, safetensors, tiktoken.model)")->required();
  cmd->add_option("--host", o.host, "Address to listen on (default 127.0.0.1)");
  cmd->add_option("--port", o.port, "Port to listen on (default 8000; 0 = any free port, logged)");
  cmd->add_option("--device", o.device, "Backend of the worker: cpu or cuda (default cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--max-num-seqs", a->max_num_seqs, "Most sequences in a running batch (default: the worker's)");
  cmd->add_option("--max-model-len", a->max_model_len, "Context length: prompt + completion tokens (default: the "
                  "model's, capped by the worker)");
  cmd->add_option("--chunked-prefill-size", a->chunked_prefill_size, "Most prompt tokens per step (default: the "
                  "worker's)");
  cmd->add_option("--max-queue", a->max_queue, "Most requests waiting at the worker; more are rejected (default: the "
                  "worker's)");
  cmd->add_option("--api-key", o.api_key, "Require 'Authorization: Bearer <key>' on /v1/* (default: none)");
  cmd->add_option("--chat-template", o.chat_template, "A Jinja chat template file used instead of the checkpoint's");
  cmd->add_option("--served-model-name", o.served_model_name, "Model name in the API (default: the directory name)");
  add_parallel_flags(cmd, a->par, true);
  cmd->add_option("--distributed-weight-config", o.distributed_weight_config, "Cross-node weight placement JSON (not "
                  "available yet)");
  cmd->callback([a] {
    a->opt.max_num_seqs = given(a->max_num_seqs);
    a->opt.max_model_len = given(a->max_model_len);
    a->opt.chunked_prefill_size = given(a->chunked_prefill_size);
    a->opt.max_queue = given(a->max_queue);
    a->opt.parallel = a->par.flags();
    a->opt.dist_init_addr = a->par.dist_init_addr;
    a->opt.k3_moe_exchange = a->par.exchange;
    a->opt.moe_exchange_tokens = a->par.max_tokens_per_call;
    const int rc = frontend::run_serve(a->opt);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace bg::tools
