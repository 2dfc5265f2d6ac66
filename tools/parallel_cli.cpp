// Parallel flags and the local rank set of score / generate.
#include "tools/parallel_cli.h"

#include <stdlib.h>
#include <unistd.h>

#include <limits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "dist/rank_setup.h"
#include "dist/rendezvous.h"
#include "moe/expert_stream.h"

namespace bg::tools {

namespace fs = std::filesystem;

dist::ParallelFlags ParallelArgs::flags() const {
  dist::ParallelFlags f;
  if (tp != 0) f.tp = tp;
  if (dp != 0) f.dp = dp;
  if (ep != 0) f.ep = ep;
  f.nnodes = nnodes;
  f.node_rank = node_rank;
  return f;
}

void add_parallel_flags(CLI::App* cmd, ParallelArgs& a, bool with_nodes) {
  cmd->add_option("--tp,--tp-size", a.tp, "Tensor-parallel ranks per DP attention group (default 1)");
  cmd->add_option("--dp,--dp-size", a.dp, "Data-parallel attention groups (default: ranks / tp)");
  cmd->add_option("--ep,--ep-size", a.ep, "Expert-parallel ranks: the routed experts are spread over every rank, so "
                  "this is the number of ranks (default: dp x tp)");
  cmd->add_option("--k3-moe-exchange", a.exchange, "Expert exchange between CUDA ranks: nccl (default; all-to-all "
                  "of bf16 rows, one GPU per rank) or ll (low-latency fixed slots over CUDA IPC, one host, ranks may "
                  "share GPUs) or ll-fp8 (the same with FP8 E4M3 dispatch rows: half the bytes, quantized expert inputs). CPU "
                  "ranks always use the shared-memory exchange with the ll slot layout")
      ->check(CLI::IsMember({"nccl", "ll", "ll-fp8"}));
  cmd->add_option("--moe-exchange-tokens", a.max_tokens_per_call, "Tokens per rank one expert exchange call carries "
                  "(larger steps go in rounds; default: the exchange's)");
  if (!with_nodes) return;
  cmd->add_option("--nnodes", a.nnodes, "Hosts the ranks span (default 1)");
  cmd->add_option("--node-rank", a.node_rank, "This host's index among --nnodes (default 0)");
  cmd->add_option("--dist-init-addr", a.dist_init_addr, "host:port of node 0's rendezvous (needed with --nnodes > 1)");
}

std::unique_ptr<LocalRanks> LocalRanks::start(const ParallelArgs& args, const fs::path& model_dir,
                                              const LoadOptions& options, StateSize state) {
  const dist::ParallelLayout layout = args.layout();
  if (!layout.multi_rank()) return nullptr;
  BG_CHECK(layout.nnodes() == 1, "score / generate run every rank on this host (--nnodes {})", layout.nnodes());
  BG_CHECK(args.max_tokens_per_call >= 0, "--moe-exchange-tokens {} must be >= 0", args.max_tokens_per_call);
  std::unique_ptr<LocalRanks> set(new LocalRanks());
  std::string tmpl = (fs::temp_directory_path() / "batchgen-ranks-XXXXXX").string();
  BG_CHECK(mkdtemp(tmpl.data()) != nullptr, "cannot create a private directory under {}",
           fs::temp_directory_path().string());
  set->dir_ = tmpl;
  const std::string endpoint = "ipc://" + (set->dir_ / "rendezvous.sock").string();
  zmq::context_t zctx(1);
  dist::RendezvousServer server(zctx, endpoint, layout.world(), layout.describe());
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  for (int32_t r = 1; r < layout.world(); ++r) {
    std::vector<std::string> argv{exe, "rank", "--model", model_dir.string(), "--device", options.device,
                                  "--rank", std::to_string(r), "--dp", std::to_string(layout.dp()),
                                  "--tp", std::to_string(layout.tp()), "--k3-moe-exchange", args.exchange,
                                  "--moe-exchange-tokens", std::to_string(args.max_tokens_per_call),
                                  "--rendezvous", endpoint};
    for (const auto& [flag, value] : {std::pair<const char*, const std::string&>{"--weight-store", options.weight_store},
                                      {"--distributed-weight-config", options.distributed_weight_config}}) {
      if (value.empty()) continue;
      argv.push_back(flag);
      argv.push_back(value);
    }
    for (std::string& f : moe::residency_flags(options.resident_experts, options.expert_trace)) {
      argv.push_back(std::move(f));
    }
    set->children_.spawn(r, argv);
  }
  log::info("{}: rank 0 here, ranks 1..{} started", layout.describe(), layout.world() - 1);
  dist::RankSetup s;
  s.place = {layout, 0};
  s.device = options.device;
  s.exchange = args.exchange;
  s.rendezvous = endpoint;
  s.plan = {state.max_sequences, state.max_tokens};
  s.max_tokens_per_call = args.max_tokens_per_call;
  s.abandon = [&set] { return set->children_.any_exited(); };  // a child died before the set was complete
  set->ctx_ = dist::start_rank(s).ranks;
  return set;
}

LocalRanks::~LocalRanks() {
  children_.wait_all(std::chrono::milliseconds(2000));
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

void LocalRanks::finish(Model& model) {
  model.sync_idle(true, {});  // a stop vote runs no step: no pools needed
  if (!children_.wait_all(std::chrono::seconds(30))) fail("a rank process failed: {}", children_.failures());
}

}  // namespace bg::tools
