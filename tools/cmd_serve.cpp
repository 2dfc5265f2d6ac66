// `batchgen serve <model-dir>` (or `--model DIR`): the OpenAI-compatible HTTP frontend plus its supervised worker
// processes (flags in vLLM/SGLang conventions); the lifecycle lives in src/server/frontend/serve.cpp.
#include <memory>

#include "core/error.h"
#include "server/frontend/serve.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/parallel_cli.h"

namespace bg::tools {
namespace {

// CLI11 fills plain integers; -1 stands for "not given" (the worker's default).
struct ServeArgs {
  frontend::ServeOptions opt;
  ParallelArgs par;
  std::string model_positional;
  std::string model_flag;
  int64_t max_num_seqs = -1;
  int64_t max_model_len = -1;
  int64_t chunked_prefill_size = -1;
  int64_t idle_prefill_size = -1;
  int64_t max_queue = -1;
  int64_t max_connections = -1;
  int64_t prefix_snapshot_interval = -1;
  double host_memory_gb = -1.0;
  int64_t swap_quantum_steps = -1;
};

std::optional<int64_t> given(int64_t v) { return v == -1 ? std::nullopt : std::optional<int64_t>(v); }

void add_http_options(CLI::App* cmd, ServeArgs& a) {
  frontend::ServeOptions& o = a.opt;
  cmd->add_option("--host", o.host, "Address to listen on (default 127.0.0.1)");
  cmd->add_option("--port", o.port, "Port to listen on (default 8000; 0 = any free port, logged)");
  cmd->add_option("--api-key", o.api_key, "Require 'Authorization: Bearer <key>' on /v1/* (default: none)");
  cmd->add_option("--served-model-name", o.served_model_name, "Model name in the API (default: the directory name)");
  cmd->add_option("--max-connections", a.max_connections, "Open client connections served (default 4096, within "
                  "the file-descriptor limit); 64 more answer only /health and /ready");
  cmd->add_option("--header-timeout", o.header_timeout_s, "Seconds for a request header to arrive (default 10)");
  cmd->add_option("--keep-alive-timeout", o.keep_alive_timeout_s, "Seconds an idle connection is kept between "
                  "requests (default 5)");
  cmd->add_option("--allowed-hosts", o.allowed_hosts, "Accept only these Host header names (comma-separated; "
                  "default: any) against DNS rebinding; /health and /ready are exempt")->delimiter(',');
  cmd->add_flag("--strict-params", o.strict_params, "Reject requests with unknown fields (400) instead of logging "
                "and ignoring them");
  cmd->add_option("--shutdown-timeout", o.shutdown_timeout_s, "On SIGTERM/SIGINT: seconds in-flight requests get to "
                  "finish before the server stops (default 30)");
}

}  // namespace

void register_serve(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  frontend::ServeOptions& o = a->opt;
  auto* cmd = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API");
  cmd->add_option("model-dir", a->model_positional, "Model directory (config.json, safetensors, tokenizer.json or tiktoken.model)");
  cmd->add_option("--model", a->model_flag, "Model directory (the same as the positional argument)");
  add_http_options(cmd, *a);
  cmd->add_option("--device", o.device, "Backend of the worker: cpu or cuda (default cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--max-num-seqs", a->max_num_seqs, "Most sequences in a running batch (default: the worker's)");
  cmd->add_option("--max-model-len", a->max_model_len, "Context length: prompt + completion tokens (default: the "
                  "model's, capped by the worker)");
  cmd->add_option("--chunked-prefill-size", a->chunked_prefill_size, "Most prompt tokens per step (default: the "
                  "worker's)");
  cmd->add_option("--idle-prefill-size", a->idle_prefill_size, "Prompt tokens per step when no sequence decodes in "
                  "it, so a lone prompt prefills faster (default: 8192 on cuda, off on cpu; 0: off)");
  cmd->add_option("--max-queue", a->max_queue, "Most requests waiting at the worker; more are rejected (default: the "
                  "worker's)");
  cmd->add_option("--worker-heartbeat-timeout", o.worker_heartbeat_timeout_s, "Seconds without a heartbeat after "
                  "which a worker counts as hung and the worker set is restarted (default 60)");
  cmd->add_option("--node-timeout", o.node_timeout_s, "With --nnodes > 1: seconds without a message from a node's "
                  "agent after which node 0 counts it (and its ranks) as gone, and an agent stops its ranks (then "
                  "waits for node 0 to come back, up to BG_RANK_TIMEOUT_S) when node 0 is silent this long (default "
                  "10)");
  cmd->add_option("--max-worker-restarts", o.max_worker_restarts, "Restarts of the worker set in a row before the "
                  "supervisor gives up (default 5; backoff 1 s doubling to 30 s)");
  cmd->add_flag("--no-prefix-cache", [a](int64_t) { a->opt.prefix_cache = false; }, "Do not reuse the KV / state "
               "of earlier requests that share a prompt prefix (default: on)");
  cmd->add_flag("--no-step-profile", [a](int64_t) { a->opt.profile_memory = false; }, "cuda: size the KV cache "
               "without first measuring the largest prefill step's memory (default: measured and kept out of the "
               "--gpu-memory-utilization budget)");
  cmd->add_flag("--no-warmup", [a](int64_t) { a->opt.warmup = false; }, "cuda: workers report ready without "
               "running dummy requests first (default: a prefill and every decode graph bucket before ready)");
  cmd->add_option("--prefix-snapshot-interval", a->prefix_snapshot_interval, "Tokens between KDA state snapshots in "
                  "the prefix cache (default: the worker's, 512)");
  cmd->add_option("--host-memory-gb", a->host_memory_gb, "Host memory (GiB) for offloaded sequences and prefix-cache "
                  "entries (default 0: no host tier)");
  cmd->add_option("--state-offload-dtype", o.state_offload_dtype, "Offloaded KDA state: f32 (exact, default), bf16 or "
                  "fp8 (lossy)")->check(CLI::IsMember({"f32", "bf16", "fp8"}));
  cmd->add_option("--swap-quantum-steps", a->swap_quantum_steps, "With a host tier: steps a request runs before it "
                  "yields its GPU place to a waiting one (default 0: never)");
  cmd->add_flag("--deterministic", o.deterministic, "Batch-invariant results: a request gets the same tokens "
               "whatever it is batched with (slower at small batches; docs/DETERMINISM.md)");
  cmd->add_option("--chat-template", o.chat_template, "A Jinja chat template file used instead of the checkpoint's");
  add_parallel_flags(cmd, a->par, true);  // --tp/--dp/--ep, --nnodes..., --k3-moe-exchange, --moe-exchange-tokens
  cmd->add_option("--distributed-weight-config", o.distributed_weight_config, "Fetch the tensors this node lacks from "
                  "the peer weight daemons this JSON names (docs/WEIGHTS.md)");
  cmd->add_option("--weight-store", o.weight_store, "Workers attach to the weightd store NAME instead of reading the "
                  "checkpoint files (docs/WEIGHTS.md)");
  add_expert_residency_options(cmd, o.resident_experts, o.expert_trace);
  cmd->callback([a] {
    BG_CHECK(!a->model_positional.empty() || !a->model_flag.empty(),
             "serve: a model directory is required (batchgen serve DIR, or --model DIR)");
    BG_CHECK(a->model_positional.empty() || a->model_flag.empty() || a->model_positional == a->model_flag,
             "serve: two different model directories given ({} and --model {}); give one", a->model_positional,
             a->model_flag);
    a->opt.model_dir = a->model_flag.empty() ? a->model_positional : a->model_flag;
    a->opt.max_num_seqs = given(a->max_num_seqs);
    a->opt.max_model_len = given(a->max_model_len);
    a->opt.chunked_prefill_size = given(a->chunked_prefill_size);
    a->opt.idle_prefill_size = given(a->idle_prefill_size);
    a->opt.max_queue = given(a->max_queue);
    a->opt.max_connections = given(a->max_connections);
    a->opt.parallel = a->par.flags();
    a->opt.dist_init_addr = a->par.dist_init_addr;
    a->opt.node_secret_file = a->par.node_secret_file;
    warn_if_unauthenticated(a->par);
    a->opt.k3_moe_exchange = a->par.exchange;
    a->opt.moe_exchange_tokens = a->par.max_tokens_per_call;
    a->opt.prefix_snapshot_interval = given(a->prefix_snapshot_interval);
    a->opt.swap_quantum_steps = given(a->swap_quantum_steps);
    if (a->host_memory_gb >= 0.0) a->opt.host_memory_gb = a->host_memory_gb;
    const int rc = frontend::run_serve(a->opt);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace bg::tools
