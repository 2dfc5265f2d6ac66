// Parallel flags and the local rank set of score / generate.
#include "tools/parallel_cli.h"

#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

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
                  "share GPUs) or ll-fp8 (the same with FP8 E4M3 dispatch rows: half the bytes, quantized expert "
                  "inputs). CPU ranks always use the shared-memory exchange with the ll slot layout (and refuse ll-fp8)")
      ->check(CLI::IsMember({"nccl", "ll", "ll-fp8"}));
  cmd->add_option("--moe-exchange-tokens", a.max_tokens_per_call, "Tokens per rank one expert exchange call carries "
                  "(larger steps go in rounds; default: the exchange's)");
  if (!with_nodes) return;
  cmd->add_option("--nnodes", a.nnodes, "Hosts the ranks span (default 1); every node runs the same command with its "
                  "own --node-rank");
  cmd->add_option("--node-rank", a.node_rank, "This host's index among --nnodes (default 0; node 0 runs rank 0)");
  cmd->add_option("--dist-init-addr", a.dist_init_addr, "host:port on node 0 that every node reaches (needed with "
                  "--nnodes > 1): score and generate bind their rendezvous there; serve its node control socket, and "
                  "the worker link on the next port");
  cmd->add_option("--node-secret-file", a.node_secret_file, "With --nnodes > 1: a file (mode 600, at least 32 bytes) "
                  "holding a secret every node has: the links between nodes are then authenticated and encrypted "
                  "(ZeroMQ CURVE), and a peer without it cannot join. Without it those links trust their network");
}

void warn_if_unauthenticated(const ParallelArgs& a) {
  if (a.nnodes > 1 && a.node_secret_file.empty()) {
    log::warn("--nnodes {} without --node-secret-file: the links between nodes are not authenticated; anyone who "
              "reaches --dist-init-addr {} can join the set (use a private network or give a secret)", a.nnodes,
              a.dist_init_addr);
  }
}

namespace {

// tcp://HOST:PORT from --dist-init-addr HOST:PORT (node 0 binds it, the other nodes' ranks connect to it).
std::string dist_init_endpoint(const std::string& addr) {
  const size_t colon = addr.rfind(':');
  BG_CHECK(colon != std::string::npos && colon > 0, "--dist-init-addr '{}' must be host:port (node 0's address)",
           addr);
  const std::string host = addr.substr(0, colon), port = addr.substr(colon + 1);
  BG_CHECK(host.find_first_of(" \t/") == std::string::npos, "--dist-init-addr '{}': bad host '{}'", addr, host);
  int64_t p = 0;
  BG_CHECK(!port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos &&
               (p = std::stoll(port)) >= 1 && p <= 65535,
           "--dist-init-addr '{}': the port must be in [1, 65535]", addr);
  return "tcp://" + addr;
}

// The command line of a child rank (`batchgen rank`) of this node.
std::vector<std::string> rank_command(const ParallelArgs& args, const dist::ParallelLayout& layout,
                                      const fs::path& model_dir, const LoadOptions& options, int32_t rank,
                                      const std::string& endpoint) {
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  std::vector<std::string> argv{exe, "rank", "--model", model_dir.string(), "--device", options.device,
                                "--rank", std::to_string(rank), "--dp", std::to_string(layout.dp()),
                                "--tp", std::to_string(layout.tp()), "--k3-moe-exchange", args.exchange,
                                "--moe-exchange-tokens", std::to_string(args.max_tokens_per_call),
                                "--rendezvous", endpoint};
  if (layout.nnodes() > 1) {
    for (const std::string& a : {std::string("--nnodes"), std::to_string(layout.nnodes()), std::string("--node-rank"),
                                 std::to_string(layout.node_of(rank))}) {
      argv.push_back(a);
    }
  }
  for (const auto& [flag, value] : {std::pair<const char*, const std::string&>{"--weight-store", options.weight_store},
                                    {"--distributed-weight-config", options.distributed_weight_config},
                                    {"--node-secret-file", args.node_secret_file}}) {
    if (value.empty()) continue;
    argv.push_back(flag);
    argv.push_back(value);
  }
  for (std::string& f : moe::residency_flags(options.resident_experts, options.expert_trace)) {
    argv.push_back(std::move(f));
  }
  return argv;
}

}  // namespace

bool LocalRanks::runs_on_other_node(const ParallelArgs& args) {
  const dist::ParallelLayout layout = args.layout();
  return layout.nnodes() > 1 && args.node_rank > 0;
}

void LocalRanks::run_node(const ParallelArgs& args, const fs::path& model_dir, const LoadOptions& options) {
  const dist::ParallelLayout layout = args.layout();
  BG_CHECK(runs_on_other_node(args), "run_node: node {} of {} runs rank 0 itself", args.node_rank, layout.nnodes());
  BG_CHECK(args.max_tokens_per_call >= 0, "--moe-exchange-tokens {} must be >= 0", args.max_tokens_per_call);
  const std::string endpoint = dist_init_endpoint(args.dist_init_addr);
  warn_if_unauthenticated(args);
  (void)dist::load_link_key(args.node_secret_file);  // a bad secret file fails here, not in every rank
  const int32_t first = layout.first_rank_of(args.node_rank), n = layout.ranks_per_node();
  dist::ChildRanks children;
  for (int32_t r = first; r < first + n; ++r) {
    children.spawn(r, rank_command(args, layout, model_dir, options, r, endpoint));
  }
  log::info("{}: node {} of {} runs ranks {}..{}; rank 0 (node 0, {}) prints the result", layout.describe(),
            args.node_rank, layout.nnodes(), first, first + n - 1, args.dist_init_addr);
  // Until every rank here is done: rank 0 stops the set when its work is done, and a failure anywhere makes every
  // rank fail within the rank timeout, so this loop ends. A rank here that failed: the others get a moment to see it.
  for (;;) {
    children.any_exited();
    if (children.all_exited() || children.any_failed()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!children.wait_all(std::chrono::seconds(10))) {
    fail("node {}: a rank failed: {}", args.node_rank, children.failures());
  }
  log::info("node {}: every rank finished", args.node_rank);
}

std::unique_ptr<LocalRanks> LocalRanks::start(const ParallelArgs& args, const fs::path& model_dir,
                                              const LoadOptions& options, StateSize state) {
  const dist::ParallelLayout layout = args.layout();
  if (!layout.multi_rank()) return nullptr;
  BG_CHECK(!runs_on_other_node(args), "node {}: its ranks run through LocalRanks::run_node", args.node_rank);
  BG_CHECK(args.max_tokens_per_call >= 0, "--moe-exchange-tokens {} must be >= 0", args.max_tokens_per_call);
  BG_CHECK(dist::exchange_fits_device(options.device, args.exchange), "{}", dist::kLlFp8NeedsCuda);
  std::unique_ptr<LocalRanks> set(new LocalRanks());
  std::string endpoint;
  if (layout.nnodes() > 1) {
    endpoint = dist_init_endpoint(args.dist_init_addr);  // the other nodes' ranks join here
  } else {
    std::string tmpl = (fs::temp_directory_path() / "batchgen-ranks-XXXXXX").string();
    BG_CHECK(mkdtemp(tmpl.data()) != nullptr, "cannot create a private directory under {}",
             fs::temp_directory_path().string());
    set->dir_ = tmpl;
    endpoint = "ipc://" + (set->dir_ / "rendezvous.sock").string();
  }
  warn_if_unauthenticated(args);
  const dist::LinkKeyPtr key = dist::load_link_key(args.node_secret_file);
  zmq::context_t zctx(1);
  std::unique_ptr<dist::RendezvousServer> server;
  try {
    server = std::make_unique<dist::RendezvousServer>(zctx, endpoint, layout.world(), layout.describe(), key.get());
  } catch (const std::exception& e) {
    fail("cannot bind the rendezvous at {}: {}{}", endpoint, e.what(),
         layout.nnodes() > 1 ? " (--dist-init-addr must be an address of node 0 with a free port)" : "");
  }
  for (int32_t r = 1; r < layout.ranks_per_node(); ++r) {
    set->children_.spawn(r, rank_command(args, layout, model_dir, options, r, endpoint));
  }
  if (layout.nnodes() > 1) {
    log::info("{}: rank 0 here with ranks 1..{}; ranks {}..{} join from the other nodes at {}", layout.describe(),
              layout.ranks_per_node() - 1, layout.ranks_per_node(), layout.world() - 1, args.dist_init_addr);
  } else {
    log::info("{}: rank 0 here, ranks 1..{} started", layout.describe(), layout.world() - 1);
  }
  dist::RankSetup s;
  s.place = {layout, 0};
  s.device = options.device;
  s.exchange = args.exchange;
  s.rendezvous = endpoint;
  s.plan = {state.max_sequences, state.max_tokens};
  s.max_tokens_per_call = args.max_tokens_per_call;
  s.link_key = key;
  s.abandon = [&set] { return set->children_.any_exited(); };  // a child died before the set was complete
  try {
    set->ctx_ = dist::start_rank(s).ranks;
  } catch (const Error& e) {
    // Name who never came: with several nodes, usually a node whose command was not started or cannot reach us.
    const std::vector<bool> joined = server->joined();
    std::vector<std::string> missing;
    for (int32_t r = 0; r < layout.world(); ++r) {
      if (!joined[static_cast<size_t>(r)]) missing.push_back(fmt::format("{} (node {})", r, layout.node_of(r)));
    }
    if (missing.empty() || !joined[0]) throw;  // rank 0 itself did not get as far as joining: its own error says why
    fail("{}; ranks that never joined: {}", e.what(), fmt::join(missing, ", "));
  }
  return set;
}

LocalRanks::~LocalRanks() {
  children_.wait_all(std::chrono::milliseconds(2000));
  std::error_code ec;
  if (!dir_.empty()) fs::remove_all(dir_, ec);
}

void LocalRanks::finish(Model& model) {
  model.sync_idle(true, {});  // a stop vote runs no step: no pools needed
  if (!children_.wait_all(std::chrono::seconds(30))) fail("a rank process failed: {}", children_.failures());
}

}  // namespace bg::tools
