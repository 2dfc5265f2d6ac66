// The serve lifecycle: validate -> text model -> private IPC dir -> worker link -> bind HTTP -> spawn workers ->
// serve until a signal -> stop HTTP, shut workers down (never leaving one behind), remove the IPC dir.
#include "server/frontend/serve.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "core/error.h"
#include "core/log.h"
#include "server/frontend/http_server.h"
#include "server/frontend/worker_link.h"
#include "server/frontend/worker_manager.h"

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
  check_positive(opt.prefix_snapshot_interval, "--prefix-snapshot-interval");
  BG_CHECK(!opt.host_memory_gb || (*opt.host_memory_gb >= 0.0 && *opt.host_memory_gb <= 1e6),
           "--host-memory-gb {} must be in [0, 1e6]", opt.host_memory_gb.value_or(0.0));
  BG_CHECK(opt.state_offload_dtype.empty() || opt.state_offload_dtype == "f32" || opt.state_offload_dtype == "bf16" ||
           opt.state_offload_dtype == "fp8", "--state-offload-dtype {} must be f32, bf16 or fp8",
           opt.state_offload_dtype);
  if (opt.k3_moe_exchange == "ll") {
    fail("--k3-moe-exchange ll is not available yet (the low-latency expert exchange has not been implemented); "
         "use --k3-moe-exchange nccl");
  }
  BG_CHECK(opt.k3_moe_exchange == "nccl", "--k3-moe-exchange {} must be nccl or ll", opt.k3_moe_exchange);
  validate_distributed_config(opt.distributed_weight_config);
  if (opt.served_model_name.empty()) {
    fs::path p = fs::weakly_canonical(opt.model_dir, ec);
    if (ec || p.filename().empty()) p = fs::path(opt.model_dir);
    opt.served_model_name = p.filename().empty() ? p.parent_path().filename().string() : p.filename().string();
  }
}

std::vector<std::string> worker_command(const ServeOptions& opt, const std::string& exe, const std::string& endpoint,
                                        int32_t rank) {
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
  add("--prefix-snapshot-interval", opt.prefix_snapshot_interval);
  add("--swap-quantum-steps", opt.swap_quantum_steps);
  if (!opt.prefix_cache) argv.push_back("--no-prefix-cache");
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

int run_serve(ServeOptions opt) {
  validate_serve_options(opt);
  if (opt.k3_moe_exchange == "nccl") {
    log::info("serve: --k3-moe-exchange nccl: one rank, so no expert exchange runs (experts are local)");
  }
  // Before any thread starts: SIGINT/SIGTERM only reach the signal watcher; a gone client must not kill us.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::unique_ptr<TextModel> model = load_text_model(opt.model_dir, opt.chat_template);
  PrivateDir ipc_dir;
  const std::string endpoint = "ipc://" + (ipc_dir.path() / "workers.sock").string();
  zmq::context_t zmq_ctx;
  Metrics metrics;
  WorkerLink link(zmq_ctx, endpoint, 1);
  link.start();
  FrontendServer server(FrontendConfig{opt.served_model_name, opt.api_key, opt.max_body_bytes, opt.n_http_threads},
                        *model, link, metrics);
  const int port = server.bind(opt.host, opt.port);

  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  WorkerManager workers(link);
  workers.spawn(0, worker_command(opt, exe, endpoint, 0));
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
  return ok ? 0 : 1;
}

}  // namespace bg::frontend
