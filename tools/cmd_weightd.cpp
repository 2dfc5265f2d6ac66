// `batchgen weightd start|status|stop`: the host weight-store daemon (docs/WEIGHTS.md). `start` forks the daemon
// (setsid, logs to the runtime directory) and returns once the store is ready, showing the load's progress meanwhile;
// `--foreground` runs it in this process.
#include <fcntl.h>
#include <numa.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "tools/commands.h"
#include "weights/control.h"
#include "weights/daemon.h"
#include "weights/progress.h"
#include "weights/upload_bench.h"

namespace bg::tools {
namespace {

using weights::DaemonOptions;

struct StartArgs {
  DaemonOptions d;
  bool foreground = false;
  double segment_gb = 8.0;
  std::string reader = "auto";
  bool no_direct = false;
  std::string on_corrupt = "reload";
  std::string numa = "auto";
  std::string expert_layout = "checkpoint";
};

void finish_options(StartArgs& a) {
  BG_CHECK(a.segment_gb >= 0.001 && a.segment_gb <= 1024, "--segment-gb {} must be in [0.001, 1024]", a.segment_gb);
  a.d.build.layout.segment_max_bytes = static_cast<uint64_t>(a.segment_gb * 1e9);
  a.d.build.read.kind = a.reader == "io_uring" ? weights::ReaderKind::kUring
                        : a.reader == "pread"  ? weights::ReaderKind::kPread
                                               : weights::ReaderKind::kAuto;
  a.d.build.read.direct = !a.no_direct;
  a.d.on_corrupt = a.on_corrupt == "refuse" ? weights::OnCorrupt::kRefuse : weights::OnCorrupt::kReload;
  const int nodes = numa_available() >= 0 ? numa_num_configured_nodes() : 1;
  a.d.build.layout.n_numa_nodes = a.numa == "off" ? 1 : std::max(1, nodes);
  a.d.build.expert_layout = weights::parse_expert_layout(a.expert_layout);
  BG_CHECK(a.d.build.expert_layout == weights::ExpertLayout::kCheckpoint || a.d.distributed_config.empty(),
           "--expert-layout w4a16 is not supported with --distributed-weight-config yet");
  BG_CHECK(std::filesystem::is_directory(a.d.model_dir), "--model {}: not a directory", a.d.model_dir.string());
  BG_CHECK(a.d.distributed_config.empty() == a.d.node.empty(),
           "--distributed-weight-config and --node go together (the node is this daemon's entry in the config)");
  BG_CHECK(!a.d.fetch_missing || !a.d.distributed_config.empty(), "--fetch-missing needs --distributed-weight-config");
  weights::check_store_name(a.d.name);
}

void print_status(const std::string& name) {
  const auto reply = weights::control_request(name, {{"cmd", "status"}});
  std::cout << reply.value("status", nlohmann::json::object()).dump(2) << "\n";
}

int run_foreground(const StartArgs& a) {
  weights::WeightDaemon daemon(a.d);
  return daemon.run([&](const std::string& error) {
    if (error.empty()) log::info("weight store {} is ready; Ctrl-C stops the daemon and keeps the store", a.d.name);
  });
}

// The forked daemon: own session, stdio to the log file, readiness (or the error) written once to `ready_fd`.
[[noreturn]] void daemon_child(StartArgs a, int ready_fd) {
  ::setsid();
  const int log_fd = ::open(weights::log_file_path(a.d.name).c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (log_fd >= 0) {
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
  }
  if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
  a.d.progress_tty = 0;
  std::atomic<bool> told{false};
  auto tell = [&](const std::string& error) {
    if (told.exchange(true)) return;
    const std::string msg = error.empty() ? "ok\n" : "error: " + error + "\n";
    (void)!::write(ready_fd, msg.data(), msg.size());
    ::close(ready_fd);
  };
  int rc = 1;
  try {
    weights::WeightDaemon daemon(a.d);
    rc = daemon.run(tell);
  } catch (const std::exception& e) {
    log::error("{}", e.what());
    tell(e.what());
  }
  std::fflush(nullptr);
  ::_exit(rc);
}

// Waits for the child's readiness message, drawing the load's progress from the daemon's status meanwhile; throws
// the daemon's error.
int wait_for_daemon(const StartArgs& a, int ready_fd, pid_t child) {
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  auto last_log = std::chrono::steady_clock::now();
  std::string msg;
  for (;;) {
    pollfd p{ready_fd, POLLIN, 0};
    if (::poll(&p, 1, 250) > 0) {
      char buf[4096];
      const ssize_t n = ::read(ready_fd, buf, sizeof(buf));
      if (n > 0) {
        msg.append(buf, static_cast<size_t>(n));
        continue;
      }
      break;  // EOF: the child closed the pipe (told us, or died)
    }
    try {
      const auto st = weights::control_request(a.d.name, {{"cmd", "status"}}, 1000).value("status", nlohmann::json{});
      const auto pr = st.value("progress", nlohmann::json::object());
      const std::string line = fmt::format("weightd {}: {}{}", a.d.name, st.value("phase", std::string("?")),
                                           pr.empty() ? std::string()
                                                      : fmt::format(" {} / {}", weights::format_bytes(pr["bytes"]),
                                                                    weights::format_bytes(pr["total"])));
      if (tty) {
        std::fprintf(stderr, "\r\x1b[2K%s", line.c_str());
      } else if (std::chrono::steady_clock::now() - last_log > std::chrono::seconds(10)) {
        log::info("{}", line);
        last_log = std::chrono::steady_clock::now();
      }
    } catch (const Error&) {
      // the control socket is not up yet
    }
  }
  ::close(ready_fd);
  if (tty) std::fprintf(stderr, "\r\x1b[2K");
  if (msg.rfind("ok", 0) == 0) {
    print_status(a.d.name);
    return 0;
  }
  // The daemon failed: wait for it to exit (it releases the store's lock last), so a retry does not find it running.
  int status = 0;
  for (int i = 0; i < 300 && ::waitpid(child, &status, WNOHANG) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  BG_CHECK(msg.rfind("error: ", 0) != 0, "weightd {}: {}", a.d.name, msg.substr(7, msg.find_last_not_of('\n') - 6));
  fail("weightd {}: the daemon (pid {}) exited during startup; see {}", a.d.name, child,
       weights::log_file_path(a.d.name).string());
}

int run_start(StartArgs a) {
  finish_options(a);
  BG_CHECK(!weights::daemon_running(a.d.name), "a weight daemon named '{}' is already running (`batchgen weightd "
           "status --name {}`)", a.d.name, a.d.name);
  if (a.foreground) return run_foreground(a);
  (void)weights::runtime_dir();  // fails here, in the terminal, if the directory is unsafe
  int fds[2];
  BG_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "pipe: {}", std::strerror(errno));
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  BG_CHECK(pid >= 0, "fork: {}", std::strerror(errno));
  if (pid == 0) {
    ::close(fds[0]);
    daemon_child(std::move(a), fds[1]);
  }
  ::close(fds[1]);
  log::info("weightd {}: daemon pid {}, log {}", a.d.name, pid, weights::log_file_path(a.d.name).string());
  return wait_for_daemon(a, fds[0], pid);
}

int run_stop(const std::string& name, bool keep) {
  weights::check_store_name(name);
  if (!weights::daemon_running(name)) {
    BG_CHECK(!weights::list_store_shm(name).empty(), "no weight store named '{}' (no daemon, no segments)", name);
    if (keep) {
      log::info("weightd {}: no daemon is running; the segments stay (a new daemon adopts them)", name);
      return 0;
    }
    log::info("weightd {}: no daemon was running; removed {} leftover shared-memory objects", name,
              weights::remove_store_shm(name));
    return 0;
  }
  const auto reply = weights::control_request(name, {{"cmd", "shutdown"}, {"keep_segments", keep}});
  const auto st = reply.value("status", nlohmann::json::object());
  const pid_t pid = st.value("pid", 0);
  if (const int n = st.value("clients", 0); n > 0) {
    log::warn("weightd {}: {} engine(s) still attached; their mappings stay valid until they exit", name, n);
  }
  for (int i = 0; i < 600 && weights::daemon_running(name); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  BG_CHECK(!weights::daemon_running(name), "weightd {}: the daemon (pid {}) did not exit within 60 s", name, pid);
  log::info("weightd {}: stopped{}", name, keep ? " (segments kept)" : "");
  return 0;
}

}  // namespace

void register_weightd(CLI::App& app) {
  auto* cmd = app.add_subcommand("weightd", "Host weight-store daemon: a checkpoint in shared memory for engines");
  cmd->require_subcommand(1);
  auto start = std::make_shared<StartArgs>();
  auto* s = cmd->add_subcommand("start", "Load (or adopt) the store and return once it is ready");
  s->add_option("--model", start->d.model_dir, "Checkpoint directory (safetensors, or a store-layout directory)")
      ->required();
  s->add_option("--name", start->d.name, "Store name ([A-Za-z0-9_-], engines attach with --weight-store NAME)")
      ->required();
  s->add_flag("--foreground", start->foreground, "Run the daemon in this process (logs to the terminal)");
  s->add_option("--segment-gb", start->segment_gb, "Largest shared-memory segment in GB (default 8)");
  s->add_option("--threads", start->d.build.read.n_threads, "Reader threads (default: min(cores, 16))");
  s->add_option("--reader", start->reader, "auto (io_uring where allowed), io_uring or pread")
      ->check(CLI::IsMember({"auto", "io_uring", "pread"}));
  s->add_flag("--no-direct", start->no_direct, "Read through the page cache (no O_DIRECT)");
  s->add_option("--on-corrupt", start->on_corrupt, "An adopted store with corrupt tensors: reload them (default) or "
                "refuse to start")->check(CLI::IsMember({"reload", "refuse"}));
  s->add_option("--numa", start->numa, "auto: spread segments over the NUMA nodes; off")
      ->check(CLI::IsMember({"auto", "off"}));
  s->add_option("--expert-layout", start->expert_layout, "checkpoint (default) or w4a16: MXFP4 experts held in the GPU "
                "kernel's layout (uploads and streamed experts copy with no re-layout)")
      ->check(CLI::IsMember({"checkpoint", "w4a16"}));
  s->add_option("--distributed-weight-config", start->d.distributed_config, "Nodes, shards and shared secret (JSON)");
  s->add_option("--node", start->d.node, "This daemon's node in the distributed config");
  s->add_flag("--fetch-missing", start->d.fetch_missing, "Also fetch the other nodes' shards from their daemons");
  s->callback([start] {
    if (run_start(*start) != 0) fail("weightd {}: the daemon stopped with an error", start->d.name);
  });
  auto status_name = std::make_shared<std::string>();
  auto* st = cmd->add_subcommand("status", "Print the daemon's status as JSON");
  st->add_option("--name", *status_name, "Store name")->required();
  st->callback([status_name] { print_status(*status_name); });
  auto stop_name = std::make_shared<std::string>();
  auto keep = std::make_shared<bool>(false);
  auto* sp = cmd->add_subcommand("stop", "Stop the daemon and remove the store (engines keep their mappings)");
  sp->add_option("--name", *stop_name, "Store name")->required();
  sp->add_flag("--keep-segments", *keep, "Leave the store in shared memory for the next daemon to adopt");
  sp->callback([stop_name, keep] { run_stop(*stop_name, *keep); });
  struct BenchArgs {
    std::string name;
    int device = 0;
    int repeats = 3;
  };
  auto bench = std::make_shared<BenchArgs>();
  auto* b = cmd->add_subcommand("bench", "CUDA builds: store -> GPU copy rate beside the pinned host-to-device rate");
  b->add_option("--name", bench->name, "Store name (its daemon must be running)")->required();
  b->add_option("--device-index", bench->device, "CUDA device (default 0)");
  b->add_option("--repeats", bench->repeats, "Best of this many passes (default 3)");
  b->callback([bench] {
    std::cout << weights::bench_store_upload(bench->name, bench->device, bench->repeats).dump(2) << "\n";
  });
}

}  // namespace bg::tools
