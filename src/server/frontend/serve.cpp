// The serve lifecycle: validate -> text model -> sweep stale IPC dirs, private IPC dir -> worker link (and, across
// nodes, the node link) -> bind HTTP -> supervised workers -> serve until a signal (then drain) or a worker that fails
// before it was ever ready -> stop HTTP, shut workers down (never leaving one behind), remove the IPC dir. Node k > 0
// of a set that spans hosts runs the node agent instead.
#include "server/frontend/serve.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "core/error.h"
#include "core/log.h"
#include "core/spawn.h"
#include "dist/rank_context.h"
#include "dist/rendezvous.h"
#include "dist/shm_comm.h"
#include "moe/expert_stream.h"
#include "server/frontend/http_server.h"
#include "server/frontend/ipc_dir.h"
#include "server/frontend/node_agent.h"
#include "server/frontend/node_link.h"
#include "server/frontend/node_protocol.h"
#include "server/frontend/worker_link.h"
#include "server/frontend/worker_manager.h"
#include "weights/dist_config.h"
#include "weights/segment.h"

namespace bg::frontend {

namespace fs = std::filesystem;

namespace {

void validate_distributed_config(const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  BG_CHECK(fs::exists(path, ec), "--distributed-weight-config {}: no such file", path);
  BG_CHECK(fs::is_regular_file(path, ec), "--distributed-weight-config {}: not a regular file", path);
  (void)weights::load_dist_config(path);  // every field checked; the worker uses it (docs/WEIGHTS.md)
}

void check_positive(const std::optional<int64_t>& v, const char* flag) {
  BG_CHECK(!v || *v >= 1, "{} {} must be >= 1", flag, v.value_or(0));
}

}  // namespace

void validate_serve_options(ServeOptions& opt) {
  std::error_code ec;
  BG_CHECK(!opt.model_dir.empty(), "serve: a model directory is required");
  BG_CHECK(fs::is_directory(opt.model_dir, ec), "serve: model directory {} does not exist or is not a directory",
           opt.model_dir);
  BG_CHECK(opt.port >= 0 && opt.port <= 65535, "--port {} must be in [0, 65535]", opt.port);
  BG_CHECK(opt.device == "cpu" || opt.device == "cuda", "--device {} must be cpu or cuda", opt.device);
  check_positive(opt.max_num_seqs, "--max-num-seqs");
  check_positive(opt.max_model_len, "--max-model-len");
  check_positive(opt.chunked_prefill_size, "--chunked-prefill-size");
  BG_CHECK(!opt.idle_prefill_size || *opt.idle_prefill_size >= 0, "--idle-prefill-size {} must be >= 0 (0: off)",
           opt.idle_prefill_size.value_or(0));
  check_positive(opt.max_connections, "--max-connections");
  BG_CHECK(!opt.max_queue || *opt.max_queue >= 0, "--max-queue {} must be >= 0", opt.max_queue.value_or(0));
  auto check_seconds = [](double v, const char* flag, double lo) {
    BG_CHECK(std::isfinite(v) && v >= lo && v <= 86400.0, "{} {} must be in [{}, 86400] seconds", flag, v, lo);
  };
  check_seconds(opt.header_timeout_s, "--header-timeout", 0.1);
  check_seconds(opt.keep_alive_timeout_s, "--keep-alive-timeout", 0.1);
  check_seconds(opt.shutdown_timeout_s, "--shutdown-timeout", 0.0);
  check_seconds(opt.worker_heartbeat_timeout_s, "--worker-heartbeat-timeout", 1.5);
  BG_CHECK(opt.max_worker_restarts >= 0 && opt.max_worker_restarts <= 1000, "--max-worker-restarts {} must be in "
           "[0, 1000]", opt.max_worker_restarts);
  for (std::string& h : opt.allowed_hosts) {
    std::transform(h.begin(), h.end(), h.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);  // [::1] -> ::1
    const bool host_and_port = std::count(h.begin(), h.end(), ':') == 1;
    BG_CHECK(!h.empty() && h.find_first_of(" /\t") == std::string::npos && !host_and_port,
             "--allowed-hosts: '{}' is not a host name or address (give names without port or scheme, e.g. "
             "localhost,api.example.com)", h);
  }
  check_positive(opt.prefix_snapshot_interval, "--prefix-snapshot-interval");
  BG_CHECK(!opt.host_memory_gb || (*opt.host_memory_gb >= 0.0 && *opt.host_memory_gb <= 1e6),
           "--host-memory-gb {} must be in [0, 1e6]", opt.host_memory_gb.value_or(0.0));
  BG_CHECK(opt.state_offload_dtype.empty() || opt.state_offload_dtype == "f32" || opt.state_offload_dtype == "bf16" ||
           opt.state_offload_dtype == "fp8", "--state-offload-dtype {} must be f32, bf16 or fp8",
           opt.state_offload_dtype);
  BG_CHECK(dist::is_cuda_exchange(opt.k3_moe_exchange), "--k3-moe-exchange {} must be {}", opt.k3_moe_exchange,
           dist::kCudaExchangeNames);
  BG_CHECK(dist::exchange_fits_device(opt.device, opt.k3_moe_exchange), "{}", dist::kLlFp8NeedsCuda);
  BG_CHECK(opt.moe_exchange_tokens >= 0, "--moe-exchange-tokens {} must be >= 0", opt.moe_exchange_tokens);
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(opt.parallel);  // throws on a bad layout
  // TP ranks mirror their leader's pools; the host tier moves state in the leader's only (docs/PARALLEL.md).
  BG_CHECK(layout.tp() == 1 || opt.host_memory_gb.value_or(0.0) == 0.0,
           "--host-memory-gb is not available with --tp {} (docs/PARALLEL.md)", layout.tp());
  check_seconds(opt.node_timeout_s, "--node-timeout", 0.5);
  if (layout.nnodes() > 1) {
    (void)nodes::node_endpoints(opt.dist_init_addr);  // throws naming --dist-init-addr
    BG_CHECK(opt.device != "cuda" || !dist::is_ll_exchange(opt.k3_moe_exchange), "--k3-moe-exchange {} runs within "
             "one host (CUDA IPC); {} nodes need --k3-moe-exchange nccl", opt.k3_moe_exchange, layout.nnodes());
  }
  validate_distributed_config(opt.distributed_weight_config);
  (void)dist::load_link_key(opt.node_secret_file);  // a bad secret file fails here, not in every worker
  if (!opt.weight_store.empty()) weights::check_store_name(opt.weight_store);
  if (opt.served_model_name.empty()) {
    fs::path p = fs::weakly_canonical(opt.model_dir, ec);
    if (ec || p.filename().empty()) p = fs::path(opt.model_dir);
    opt.served_model_name = p.filename().empty() ? p.parent_path().filename().string() : p.filename().string();
  }
}

std::vector<std::string> worker_command(const ServeOptions& opt, const std::string& exe, const std::string& endpoint,
                                        int32_t rank, const std::string& identity, const std::string& rendezvous) {
  std::vector<std::string> argv = {exe,          "worker",       "--model",      opt.model_dir,
                                   "--endpoint", endpoint,       "--rank",       std::to_string(rank),
                                   "--routing-id", identity,     "--parent-pid", std::to_string(getpid()),
                                   "--device",   opt.device};
  auto add = [&](const char* flag, const std::optional<int64_t>& v) {
    if (v) {
      argv.push_back(flag);
      argv.push_back(std::to_string(*v));
    }
  };
  add("--max-num-seqs", opt.max_num_seqs);
  add("--max-model-len", opt.max_model_len);
  add("--chunked-prefill-size", opt.chunked_prefill_size);
  add("--idle-prefill-size", opt.idle_prefill_size);
  add("--max-queue", opt.max_queue);
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(opt.parallel);
  if (layout.multi_rank()) {
    for (const std::string& a : {std::string("--dp"), std::to_string(layout.dp()), std::string("--tp"),
                                 std::to_string(layout.tp()), std::string("--rendezvous"), rendezvous,
                                 std::string("--k3-moe-exchange"), opt.k3_moe_exchange,
                                 std::string("--moe-exchange-tokens"), std::to_string(opt.moe_exchange_tokens)}) {
      argv.push_back(a);
    }
  }
  if (layout.nnodes() > 1) {
    for (const std::string& a : {std::string("--nnodes"), std::to_string(layout.nnodes()), std::string("--node-rank"),
                                 std::to_string(layout.node_of(rank))}) {
      argv.push_back(a);
    }
  }
  for (const auto& [flag, value] : {std::pair<const char*, const std::string&>{"--weight-store", opt.weight_store},
                                    {"--distributed-weight-config", opt.distributed_weight_config},
                                    {"--node-secret-file", opt.node_secret_file}}) {
    if (!value.empty()) {
      argv.push_back(flag);
      argv.push_back(value);
    }
  }
  for (std::string& f : moe::residency_flags(opt.resident_experts, opt.expert_trace)) argv.push_back(std::move(f));
  add("--prefix-snapshot-interval", opt.prefix_snapshot_interval);
  add("--swap-quantum-steps", opt.swap_quantum_steps);
  if (!opt.prefix_cache) argv.push_back("--no-prefix-cache");
  if (!opt.warmup) argv.push_back("--no-warmup");
  if (!opt.profile_memory) argv.push_back("--no-step-profile");
  if (opt.deterministic) argv.push_back("--deterministic");
  if (opt.host_memory_gb) {
    argv.push_back("--host-memory-gb");
    argv.push_back(fmt::format("{}", *opt.host_memory_gb));
  }
  if (!opt.state_offload_dtype.empty()) {
    argv.push_back("--state-offload-dtype");
    argv.push_back(opt.state_offload_dtype);
  }
  return argv;
}

std::string node_config_signature(const ServeOptions& opt) {
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(opt.parallel);
  return fmt::format("{}; --device {} --k3-moe-exchange {} --moe-exchange-tokens {}", layout.describe(), opt.device,
                     opt.k3_moe_exchange, opt.moe_exchange_tokens);
}

namespace {

using Ms = std::chrono::milliseconds;

Ms to_ms(double seconds) { return Ms(static_cast<int64_t>(std::llround(seconds * 1000.0))); }

// Raises the soft file-descriptor limit to the hard one and fits the connection cap into it (each connection is
// one descriptor; 256 are kept for the rest of the process).
size_t connection_cap(const ServeOptions& opt, size_t reserve) {
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
    getrlimit(RLIMIT_NOFILE, &lim);
  }
  const size_t fds = lim.rlim_cur == RLIM_INFINITY ? size_t{1} << 20 : static_cast<size_t>(lim.rlim_cur);
  const size_t usable = fds > 256 + reserve ? fds - 256 - reserve : 1;
  if (opt.max_connections) {
    BG_CHECK(static_cast<size_t>(*opt.max_connections) <= usable, "--max-connections {} needs more file descriptors "
             "than the limit allows ({}; raise it with ulimit -n)", *opt.max_connections, fds);
    return static_cast<size_t>(*opt.max_connections);
  }
  const size_t cap = std::min<size_t>(4096, usable);
  if (cap < 4096) log::info("serve: at most {} connections (the file-descriptor limit is {})", cap, fds);
  return cap;
}

FrontendConfig frontend_config(const ServeOptions& opt) {
  FrontendConfig c;
  c.served_model_name = opt.served_model_name;
  c.api_key = opt.api_key;
  c.allowed_hosts = opt.allowed_hosts;
  c.strict_params = opt.strict_params;
  c.max_body_bytes = opt.max_body_bytes;
  c.max_connections = connection_cap(opt, c.reserve_connections);
  c.header_timeout = to_ms(opt.header_timeout_s);
  c.keep_alive_timeout = to_ms(opt.keep_alive_timeout_s);
  const auto hw = static_cast<size_t>(std::max(1u, std::thread::hardware_concurrency()));
  c.n_io_threads = std::clamp<size_t>(hw / 4, 2, 4);  // two at least: one busy thread never delays a probe
  c.n_prep_threads = std::clamp<size_t>(hw / 2, 2, 8);
  return c;
}

SupervisorConfig supervisor_config(const ServeOptions& opt, const dist::ParallelLayout& layout) {
  SupervisorConfig c;
  c.heartbeat_timeout = to_ms(opt.worker_heartbeat_timeout_s);
  c.max_restarts = static_cast<int>(opt.max_worker_restarts);
  c.node_join_timeout = to_ms(dist::rank_timeout_s(600.0));
  if (layout.nnodes() > 1) {
    // The worker link listens on TCP: routing ids nobody outside this serve can guess.
    std::random_device rd;
    c.identity_suffix = fmt::format("-{:08x}{:08x}", rd(), rd());
  }
  return c;
}

const char* signal_name(int sig) { return sig == SIGINT ? "SIGINT" : "SIGTERM"; }

// Waits for SIGINT/SIGTERM (blocked in every thread) or a worker set that failed before it was ever ready.
// Returns the signal, or 0 for the failure.
int wait_for_stop(const sigset_t& signals, const WorkerManager& workers) {
  const timespec tick{0, 200'000'000};
  for (;;) {
    const int sig = sigtimedwait(&signals, nullptr, &tick);
    if (sig > 0) return sig;
    if (workers.phase() == WorkerManager::Phase::failed_at_start) return 0;
  }
}

// Stop accepting, let the requests in flight finish (up to the timeout, or until a second signal), then return.
void drain(FrontendServer& server, const WorkerLink& link, const sigset_t& signals, double timeout_s) {
  server.begin_drain();
  const auto deadline = std::chrono::steady_clock::now() + to_ms(timeout_s);
  size_t active = server.active_requests();
  log::info("serve: draining: {} request(s) in flight, up to {:.1f} s (--shutdown-timeout); a second signal stops "
            "at once", active, timeout_s);
  const timespec tick{0, 50'000'000};
  while ((active = server.active_requests()) > 0 || link.n_in_flight() > 0) {
    if (std::chrono::steady_clock::now() >= deadline) {
      log::warn("serve: {} request(s) still in flight after {:.1f} s; stopping them", active, timeout_s);
      return;
    }
    const int sig = sigtimedwait(&signals, nullptr, &tick);
    if (sig > 0) {
      log::warn("serve: second {}; stopping {} request(s) in flight now", signal_name(sig), active);
      return;
    }
  }
  log::info("serve: every request finished");
}

}  // namespace

int run_serve(ServeOptions opt) {
  validate_serve_options(opt);
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(opt.parallel);
  if (layout.nnodes() > 1 && opt.parallel.node_rank > 0) return run_node_agent(opt);
  if (layout.multi_rank()) {
    log::info("serve: {}; expert exchange: {}", layout.describe(),
              opt.device == "cpu" ? std::string("shm (CPU ranks)") : opt.k3_moe_exchange);
  }
  // Before any thread starts: SIGINT/SIGTERM only reach sigtimedwait below; a gone client must not kill us.
  const sigset_t signals = block_stop_signals();

  const FrontendConfig http_cfg = frontend_config(opt);
  std::unique_ptr<TextModel> model = load_text_model(opt.model_dir, opt.chat_template);
  sweep_stale_ipc_dirs();
  IpcDir ipc_dir;
  // Across nodes every rank reaches node 0 over TCP on the --dist-init-addr host (node_protocol.h).
  std::optional<nodes::NodeEndpoints> node_ep;
  if (layout.nnodes() > 1) node_ep = nodes::node_endpoints(opt.dist_init_addr);
  const std::string endpoint = node_ep ? node_ep->worker_link : "ipc://" + (ipc_dir.path() / "workers.sock").string();
  zmq::context_t zmq_ctx;
  Metrics metrics;
  const dist::LinkKeyPtr link_key = dist::load_link_key(opt.node_secret_file);
  std::unique_ptr<WorkerLink> link_owner;
  try {
    link_owner = std::make_unique<WorkerLink>(zmq_ctx, endpoint, layout.world(), layout.tp(), link_key.get());
  } catch (const Error& e) {
    if (!node_ep) throw;
    fail("{} (--dist-init-addr {}: node 0 listens on that port and the next one, on an address of this host)",
         e.what(), opt.dist_init_addr);
  }
  WorkerLink& link = *link_owner;
  if (node_ep) link.set_ranks_per_node(layout.ranks_per_node());
  // One rendezvous per incarnation of the rank set, bound when the supervisor builds rank 0's command line (it spawns
  // rank 0 first), so a restarted set never meets the old one's. Only the supervisor thread touches these.
  std::unique_ptr<dist::RendezvousServer> rendezvous;
  int64_t n_sets = 0;
  auto rendezvous_for = [&](int32_t rank) -> std::string {
    if (!layout.multi_rank()) return "";
    if (rank == 0 || !rendezvous) {
      rendezvous.reset();
      rendezvous = std::make_unique<dist::RendezvousServer>(
          zmq_ctx, node_ep ? node_ep->rendezvous_bind
                           : fmt::format("ipc://{}/rendezvous-{}.sock", ipc_dir.path().string(), n_sets++),
          layout.world(), layout.describe(), link_key.get());
    }
    return rendezvous->endpoint();
  };
  // The other nodes' agents: they start their ranks on the supervisor's word (the rendezvous is the one rank 0's
  // command line just bound).
  std::unique_ptr<NodeLink> node_link;
  if (node_ep) {
    node_link = std::make_unique<NodeLink>(
        zmq_ctx, NodeLinkConfig{node_ep->control, opt.dist_init_addr, layout, node_config_signature(opt),
                                to_ms(opt.node_timeout_s), [&] {
                                  // On the --dist-init-addr host as the agents know it (bound there; the port is ours).
                                  const std::string bound = rendezvous ? rendezvous->endpoint() : "";
                                  return fmt::format("tcp://{}:{}", node_ep->host,
                                                     bound.substr(bound.rfind(':') + 1));
                                }, link_key});
    log::info("serve: node 0 of {}: ranks 0..{} here; the agents of nodes 1..{} connect to {} (the ranks' worker "
              "link is {})", layout.nnodes(), layout.ranks_per_node() - 1, layout.nnodes() - 1, node_ep->control,
              node_ep->worker_link);
  }
  link.start();
  int rc = 0;
  {
    FrontendServer server(http_cfg, *model, link, metrics);
    const int port = server.bind(opt.host, opt.port);
    const std::string exe = fs::read_symlink("/proc/self/exe").string();
    WorkerManager workers(
        link, layout.world(),
        [&](int32_t rank, const std::string& id) {
          return worker_command(opt, exe, endpoint, rank, id, rendezvous_for(rank));
        },
        supervisor_config(opt, layout), node_link.get());
    workers.start();
    server.start();
    log::info("serve: model '{}' from {}; listening on http://{}:{}", opt.served_model_name, opt.model_dir, opt.host,
              port);
    const int sig = wait_for_stop(signals, workers);
    if (sig > 0) {
      log::info("serve: {} received; shutting down", signal_name(sig));
      drain(server, link, signals, opt.shutdown_timeout_s);
    } else {
      log::error("serve: the worker failed before it was ready: {}", workers.failure());
      rc = 1;
    }
    server.stop();
    log::info("serve: stopping workers");
    workers.stop(std::chrono::seconds(10));
  }
  node_link.reset();  // goodbye to the agents: their ranks are stopped already
  link.stop();
  return rc;
}

}  // namespace bg::frontend
