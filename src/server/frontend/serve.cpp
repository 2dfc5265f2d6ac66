// The serve lifecycle: validate -> text model -> private IPC dir -> worker link -> bind HTTP -> start the rank set
// (with its rendezvous; restarted when a rank dies) -> serve until a signal -> stop HTTP, shut workers down (never
// leaving one behind), remove the IPC dir. Node k > 0 of several (--node-rank) serves no HTTP: it runs its ranks,
// which join node 0's rendezvous and worker link over TCP.
#include "server/frontend/serve.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "core/error.h"
#include "core/log.h"
#include "server/frontend/http_server.h"
#include "server/frontend/worker_link.h"
#include "server/frontend/worker_manager.h"
#include "dist/rendezvous.h"
#include "moe/make_exchange.h"

namespace bg::frontend {

namespace fs = std::filesystem;

namespace {

void validate_distributed_config(const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  BG_CHECK(fs::exists(path, ec), "--distributed-weight-config {}: no such file", path);
  BG_CHECK(fs::is_regular_file(path, ec), "--distributed-weight-config {}: not a regular file", path);
  std::ifstream in(path);
  BG_CHECK(in.good(), "--distributed-weight-config {}: cannot be read", path);
  try {
    nlohmann::json parsed = nlohmann::json::parse(in);
    BG_CHECK(parsed.is_object(), "--distributed-weight-config {}: must hold a JSON object", path);
  } catch (const nlohmann::json::exception& e) {
    fail("--distributed-weight-config {}: not valid JSON: {}", path, e.what());
  }
  fail("--distributed-weight-config {}: distributed weights are not available yet in this build (the cross-node "
       "weight store has not been implemented); serve from a local checkpoint without this flag", path);
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
  BG_CHECK(!opt.max_queue || *opt.max_queue >= 0, "--max-queue {} must be >= 0", opt.max_queue.value_or(0));
  BG_CHECK(opt.k3_moe_exchange == "nccl" || opt.k3_moe_exchange == "ll", "--k3-moe-exchange {} must be nccl or ll",
           opt.k3_moe_exchange);
  BG_CHECK(opt.moe_exchange_tokens >= 0, "--moe-exchange-tokens {} must be >= 0", opt.moe_exchange_tokens);
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(opt.parallel);
  if (opt.device == "cuda" && layout.multi_rank()) {
    BG_CHECK(opt.k3_moe_exchange == "nccl", "{}", moe::kLlNotAvailable);
  }
  if (layout.nnodes() > 1) {
    BG_CHECK(!opt.dist_init_addr.empty(), "--nnodes {} needs --dist-init-addr host:port (node 0's rendezvous)",
             layout.nnodes());
    dist::parse_host_port(opt.dist_init_addr, "--dist-init-addr");
    BG_CHECK(opt.device == "cuda", "--nnodes {}: CPU rank sets share memory, so they run on one host", layout.nnodes());
  }
  validate_distributed_config(opt.distributed_weight_config);
  if (opt.served_model_name.empty()) {
    fs::path p = fs::weakly_canonical(opt.model_dir, ec);
    if (ec || p.filename().empty()) p = fs::path(opt.model_dir);
    opt.served_model_name = p.filename().empty() ? p.parent_path().filename().string() : p.filename().string();
  }
}

std::vector<std::string> worker_command(const ServeOptions& opt, const std::string& exe, const std::string& endpoint,
                                        int32_t rank, const std::string& rendezvous) {
  std::vector<std::string> argv = {exe,        "worker",   "--model",       opt.model_dir,
                                   "--endpoint", endpoint, "--rank",        std::to_string(rank),
                                   "--parent-pid", std::to_string(getpid()), "--device", opt.device};
  auto add = [&](const char* flag, const std::optional<int64_t>& v) {
    if (v) {
      argv.push_back(flag);
      argv.push_back(std::to_string(*v));
    }
  };
  add("--max-num-seqs", opt.max_num_seqs);
  add("--max-model-len", opt.max_model_len);
  add("--chunked-prefill-size", opt.chunked_prefill_size);
  add("--max-queue", opt.max_queue);
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(opt.parallel);
  if (layout.multi_rank()) {
    for (const std::string& a : {std::string("--dp"), std::to_string(layout.dp()), std::string("--tp"),
                                 std::to_string(layout.tp()), std::string("--nnodes"), std::to_string(layout.nnodes()),
                                 std::string("--rendezvous"), rendezvous, std::string("--k3-moe-exchange"),
                                 opt.k3_moe_exchange, std::string("--moe-exchange-tokens"),
                                 std::to_string(opt.moe_exchange_tokens)}) {
      argv.push_back(a);
    }
  }
  return argv;
}

namespace {

// A private directory for the IPC socket: mkdtemp creates it with mode 0700.
class PrivateDir {
 public:
  PrivateDir() {
    std::string tmpl = (fs::temp_directory_path() / "batchgen-serve-XXXXXX").string();
    BG_CHECK(mkdtemp(tmpl.data()) != nullptr, "serve: cannot create a private directory under {}",
             fs::temp_directory_path().string());
    path_ = tmpl;
  }
  ~PrivateDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Waits for SIGINT/SIGTERM (blocked in every thread), forwards it to the workers and stops the HTTP server.
class SignalWatcher {
 public:
  SignalWatcher(FrontendServer& server, WorkerManager& workers)
      : thread_([this, &server, &workers] { watch(server, workers); }) {}
  ~SignalWatcher() {
    done_ = true;
    thread_.join();
  }

 private:
  void watch(FrontendServer& server, WorkerManager& workers) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    const timespec tick{0, 200'000'000};
    while (!done_) {
      const int sig = sigtimedwait(&set, nullptr, &tick);
      if (sig <= 0) continue;
      log::info("serve: {} received; shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
      workers.forward_shutdown_signal(sig);
      server.stop();
    }
  }
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace

namespace {

// Where the workers meet: the worker link's ROUTER and each generation's rendezvous. One node: IPC sockets in the
// private directory. Several: TCP on --dist-init-addr (rendezvous on its port, the worker link on port + 1).
struct Endpoints {
  std::string link_bind, link_connect;
  std::string rendezvous_bind(int64_t generation) const {
    return tcp_rendezvous.empty() ? fmt::format("ipc://{}/rendezvous-{}.sock", dir, generation) : tcp_rendezvous;
  }
  std::string dir, tcp_rendezvous;
};

Endpoints endpoints_for(const ServeOptions& opt, const dist::ParallelLayout& layout, const fs::path& dir) {
  Endpoints e;
  e.dir = dir.string();
  if (layout.nnodes() == 1) {
    e.link_bind = e.link_connect = "ipc://" + (dir / "workers.sock").string();
    return e;
  }
  const dist::HostPort hp = dist::parse_host_port(opt.dist_init_addr, "--dist-init-addr");
  BG_CHECK(hp.port < 65535, "--dist-init-addr {}: the worker link uses the next port", opt.dist_init_addr);
  e.tcp_rendezvous = fmt::format("tcp://{}:{}", hp.host, hp.port);
  e.link_bind = e.link_connect = fmt::format("tcp://{}:{}", hp.host, hp.port + 1);
  return e;
}

// Node k > 0: no HTTP; its ranks connect to node 0. Runs until a signal; the ranks are restarted when one dies.
int run_serve_node(const ServeOptions& opt, const dist::ParallelLayout& layout, int32_t node_rank) {
  const Endpoints ep = endpoints_for(opt, layout, fs::temp_directory_path());
  zmq::context_t zmq_ctx;
  // A local link only for this node's bookkeeping (exits, readiness in the log); the ranks report to node 0.
  WorkerLink link(zmq_ctx, "inproc://bg-node-link", layout.world(), layout.tp());
  WorkerManager workers(link);
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  RankSetSpec spec;
  spec.first_rank = layout.first_rank_of(node_rank);
  spec.n_ranks = layout.ranks_per_node();
  spec.command = [&](int32_t rank, int64_t) {
    return worker_command(opt, exe, ep.link_connect, rank, ep.tcp_rendezvous);
  };
  workers.start_set(spec);
  log::info("serve: node {} of {} runs ranks [{}, {}) for {}", node_rank, layout.nnodes(), spec.first_rank,
            spec.first_rank + spec.n_ranks, opt.dist_init_addr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  log::info("serve: node {}: {} received; stopping its ranks", node_rank, sig == SIGINT ? "SIGINT" : "SIGTERM");
  workers.forward_shutdown_signal(sig);
  workers.stop(std::chrono::seconds(10));
  return 0;
}

}  // namespace

int run_serve(ServeOptions opt) {
  validate_serve_options(opt);
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(opt.parallel);
  if (!layout.multi_rank()) {
    log::info("serve: one rank, so no expert exchange runs (--k3-moe-exchange {} applies to several ranks)",
              opt.k3_moe_exchange);
  } else {
    log::info("serve: {}; expert exchange: {}", layout.describe(),
              opt.device == "cpu" ? std::string("shm (CPU ranks)") : opt.k3_moe_exchange);
  }
  // Before any thread starts: SIGINT/SIGTERM only reach the signal watcher; a gone client must not kill us.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  if (opt.parallel.node_rank > 0) return run_serve_node(opt, layout, opt.parallel.node_rank);

  std::unique_ptr<TextModel> model = load_text_model(opt.model_dir, opt.chat_template);
  PrivateDir ipc_dir;
  const Endpoints ep = endpoints_for(opt, layout, ipc_dir.path());
  zmq::context_t zmq_ctx;
  Metrics metrics;
  WorkerLink link(zmq_ctx, ep.link_bind, layout.world(), layout.tp());
  link.start();
  FrontendServer server(FrontendConfig{opt.served_model_name, opt.api_key, opt.max_body_bytes, opt.n_http_threads},
                        *model, link, metrics);
  const int port = server.bind(opt.host, opt.port);

  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  // The rendezvous of the current generation of the rank set (replaced on each restart, from the supervisor thread).
  std::mutex rendezvous_mu;
  std::unique_ptr<dist::RendezvousServer> rendezvous;
  WorkerManager workers(link);
  RankSetSpec spec;
  spec.n_ranks = layout.ranks_per_node();
  spec.command = [&](int32_t rank, int64_t generation) {
    return worker_command(opt, exe, ep.link_connect, rank, layout.multi_rank() ? ep.rendezvous_bind(generation) : "");
  };
  if (layout.multi_rank()) {
    spec.on_generation = [&](int64_t generation) {
      std::lock_guard lock(rendezvous_mu);
      rendezvous.reset();
      rendezvous = std::make_unique<dist::RendezvousServer>(zmq_ctx, ep.rendezvous_bind(generation), layout.world(),
                                                            layout.describe());
    };
  }
  workers.start_set(spec);
  bool ok = true;
  {
    SignalWatcher watcher(server, workers);
    log::info("serve: model '{}' from {}; listening on http://{}:{}", opt.served_model_name, opt.model_dir, opt.host,
              port);
    ok = server.listen();
  }
  log::info("serve: stopping workers");
  link.shutdown_workers();
  workers.stop(std::chrono::seconds(10));
  link.stop();
  {
    std::lock_guard lock(rendezvous_mu);
    rendezvous.reset();
  }
  return ok ? 0 : 1;
}

}  // namespace bg::frontend
