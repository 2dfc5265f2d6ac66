// Helpers for the weight-store tests: a unique store name per test whose daemon and shared memory are removed even when
// the test fails, a private runtime directory, an in-process daemon, running the batchgen binary (to completion or in
// the background) and comparing logits.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "golden/golden_util.h"
#include "model/model.h"
#include "temp_dir.h"
#include "weights/control.h"
#include "weights/daemon.h"
#include "weights/segment.h"

extern char** environ;

namespace bg::testing {

inline std::filesystem::path golden_model(const std::string& c) { return golden_dir() / c / "model"; }

// Shared memory and runtime directories left by test processes that died without their destructors (a crash, a
// kill): "bg.<uid>.t<pid>_..." objects and "bg_rt_<pid>" directories whose pid is gone.
inline void sweep_dead_test_leftovers() {
  const std::string shm_prefix = fmt::format("bg.{}.t", ::geteuid());
  auto dead = [](const std::string& digits) {
    const pid_t pid = static_cast<pid_t>(std::strtol(digits.c_str(), nullptr, 10));
    return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
  };
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(shm_prefix, 0) == 0 && dead(n.substr(shm_prefix.size()))) ::shm_unlink(("/" + n).c_str());
  }
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::temp_directory_path(), ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("bg_rt_", 0) == 0 && dead(n.substr(6))) std::filesystem::remove_all(e.path(), ec);
  }
}

// BG_RUNTIME_DIR -> a fresh 0700 directory for this test process (children inherit it), so the tests never touch a
// user's real daemons; removed when the process exits.
inline void use_private_runtime_dir() {
  struct RuntimeDir {
    std::string path;
    RuntimeDir() {
      sweep_dead_test_leftovers();
      path = (std::filesystem::temp_directory_path() / ("bg_rt_" + std::to_string(::getpid()))).string();
      std::filesystem::create_directories(path);
      ::chmod(path.c_str(), 0700);
      ::setenv("BG_RUNTIME_DIR", path.c_str(), 1);
    }
    ~RuntimeDir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const RuntimeDir dir;
}

inline bool wait_for(const std::function<bool()>& pred, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// A store name unique to this test run; the destructor kills the store's daemon (if any) and removes its shared
// memory, whatever the test did.
class StoreGuard {
 public:
  explicit StoreGuard(const std::string& tag = "s") {
    use_private_runtime_dir();
    static std::atomic<int> counter{0};
    name_ = fmt::format("t{}_{}_{}", ::getpid(), counter++, tag);
    if (name_.size() > 60) name_.resize(60);
    weights::remove_store_shm(name_);
  }
  ~StoreGuard() {
    kill_daemon();
    weights::remove_store_shm(name_);
  }
  StoreGuard(const StoreGuard&) = delete;
  StoreGuard& operator=(const StoreGuard&) = delete;
  const std::string& name() const { return name_; }

  // The pid of the running daemon (from its lock file), or 0.
  pid_t daemon_pid() const {
    if (!weights::daemon_running(name_)) return 0;
    std::ifstream in(weights::lock_file_path(name_));
    pid_t pid = 0;
    in >> pid;
    return pid;
  }
  // SIGKILL to the daemon, then wait until its lock is free.
  void kill_daemon() const {
    const pid_t pid = daemon_pid();
    if (pid <= 0 || pid == ::getpid()) return;  // an in-process daemon is stopped by its owner
    ::kill(pid, SIGKILL);
    wait_for([&] { return !weights::daemon_running(name_); }, 10000);
  }

 private:
  std::string name_;
};

// A daemon running on a thread of the test process.
class InProcessDaemon {
 public:
  explicit InProcessDaemon(weights::DaemonOptions o) {
    o.handle_signals = false;
    o.progress_tty = 0;
    daemon_ = std::make_unique<weights::WeightDaemon>(std::move(o));
    thread_ = std::thread([this] {
      try {
        rc_ = daemon_->run([this](const std::string& error) { tell(error); });
      } catch (const std::exception& e) {
        rc_ = 1;
        tell(e.what());
      }
    });
  }
  ~InProcessDaemon() { stop(true); }
  // "" when ready, else the error.
  std::string wait_ready() { return ready_future_.get(); }
  void stop(bool remove_segments) {
    if (!thread_.joinable()) return;
    daemon_->request_stop(remove_segments);
    thread_.join();
  }
  int rc() const { return rc_; }

 private:
  void tell(const std::string& error) {
    if (!told_.exchange(true)) ready_.set_value(error);
  }
  std::atomic<bool> told_{false};
  std::unique_ptr<weights::WeightDaemon> daemon_;
  std::promise<std::string> ready_;
  std::shared_future<std::string> ready_future_ = ready_.get_future().share();
  std::thread thread_;
  int rc_ = -1;
};

inline weights::DaemonOptions daemon_options(const std::filesystem::path& model, const std::string& name) {
  weights::DaemonOptions o;
  o.model_dir = model;
  o.name = name;
  return o;
}

inline LoadOptions load_options(const std::string& weight_store, const std::string& device = "cpu") {
  LoadOptions o;
  o.weight_store = weight_store;
  o.device = device;
  return o;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct CmdResult {
  int rc = -1;
  std::string out, err;
};

inline std::filesystem::path batchgen_exe() { return std::filesystem::path(BG_BINARY_DIR) / "batchgen"; }

// Starts `batchgen args...` with stdout/stderr into files; returns its pid.
inline pid_t spawn_batchgen(const std::vector<std::string>& args, const std::filesystem::path& out,
                            const std::filesystem::path& err) {
  std::vector<std::string> argv = {batchgen_exe().string()};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &fa, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  EXPECT_EQ(rc, 0) << "cannot start " << argv[0];
  return rc == 0 ? pid : -1;
}

// Runs `batchgen args...` to completion (killed after timeout_s).
inline CmdResult run_batchgen(const std::vector<std::string>& args, int timeout_s = 120) {
  TempDir tmp;
  const pid_t pid = spawn_batchgen(args, tmp / "out", tmp / "err");
  CmdResult r;
  if (pid <= 0) return r;
  int status = 0;
  const bool done = wait_for([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, timeout_s * 1000);
  if (!done) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    ADD_FAILURE() << "batchgen timed out: " << ::testing::PrintToString(args);
  }
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_file(tmp / "out");
  r.err = read_file(tmp / "err");
  return r;
}

inline nlohmann::json store_status(const std::string& name) {
  return weights::control_request(name, {{"cmd", "status"}}).value("status", nlohmann::json::object());
}

// The logits `batchgen score` writes for `tokens` (extra args: --weight-store ..., --distributed-weight-config ...).
inline std::vector<float> score_logits(const std::filesystem::path& model, const std::vector<std::string>& extra,
                                       const std::string& tokens = "1,2,3,4,5,6,7,8", const std::string& prefill = "5") {
  TempDir tmp;
  std::vector<std::string> args = {"score", "--model", model.string(), "--tokens", tokens, "--prefill", prefill,
                                   "--out", (tmp / "logits.safetensors").string()};
  args.insert(args.end(), extra.begin(), extra.end());
  const CmdResult r = run_batchgen(args);
  EXPECT_EQ(r.rc, 0) << r.err;
  if (r.rc != 0) return {};
  auto f = SafetensorsFile::open(tmp / "logits.safetensors");
  return f->view("logits").to_f32();
}

}  // namespace bg::testing
