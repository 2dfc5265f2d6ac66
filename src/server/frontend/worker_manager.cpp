// fork/exec, reaping and signalling of worker processes.
#include "server/frontend/worker_manager.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "server/frontend/worker_link.h"

namespace bg::frontend {

std::string describe_exit(int wait_status) {
  if (WIFEXITED(wait_status)) return fmt::format("the worker process exited with status {}", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    return fmt::format("the worker process was killed by signal {} ({})", sig, strsignal(sig));
  }
  return fmt::format("the worker process ended (wait status {})", wait_status);
}

WorkerManager::WorkerManager(WorkerLink& link) : link_(link) {}

WorkerManager::~WorkerManager() { stop(std::chrono::milliseconds(2000)); }

void WorkerManager::spawn(int32_t rank, const std::vector<std::string>& argv) {
  BG_CHECK(!argv.empty(), "worker manager: empty command line for rank {}", rank);
  // Everything the child touches is prepared before fork: after it only async-signal-safe calls are allowed.
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  const pid_t parent = getpid();
  sigset_t none;
  sigemptyset(&none);

  const pid_t pid = fork();
  BG_CHECK(pid >= 0, "worker manager: fork failed for rank {}: {}", rank, std::strerror(errno));
  if (pid == 0) {
    sigprocmask(SIG_SETMASK, &none, nullptr);  // the frontend blocks SIGINT/SIGTERM for its signal thread
    signal(SIGPIPE, SIG_DFL);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);  // the frontend died before prctl took effect
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  log::info("frontend: started rank {} (pid {}): {}", rank, pid, fmt::join(argv, " "));
  auto child = std::make_unique<Child>();
  child->rank = rank;
  child->pid = pid;
  Child* c = child.get();
  c->reaper = std::thread([this, c] { reap(*c); });
  std::lock_guard lock(mu_);
  children_.push_back(std::move(child));
}

void WorkerManager::reap(Child& child) {
  int status = 0;
  while (waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {
  }
  child.exited = true;
  const std::string why = WIFEXITED(status) && WEXITSTATUS(status) == 127
                              ? "the worker could not be started (exec failed)"
                              : describe_exit(status);
  if (stopping_) {
    log::info("frontend: rank {} (pid {}) stopped: {}", child.rank, child.pid, why);
  } else {
    log::error("frontend: rank {} (pid {}): {}", child.rank, child.pid, why);
  }
  link_.mark_exited(child.rank, why);
}

void WorkerManager::signal_all(int sig) {
  std::lock_guard lock(mu_);
  for (const auto& c : children_) {
    if (!c->exited) kill(c->pid, sig);
  }
}

void WorkerManager::forward_shutdown_signal(int sig) {
  stopping_ = true;
  signal_all(sig);
}

bool WorkerManager::any_alive() const {
  std::lock_guard lock(mu_);
  for (const auto& c : children_) {
    if (!c->exited) return true;
  }
  return false;
}

void WorkerManager::stop(std::chrono::milliseconds grace) {
  stopping_ = true;
  signal_all(SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (any_alive() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (any_alive()) {
    log::warn("frontend: workers did not exit within {} ms; killing them", grace.count());
    signal_all(SIGKILL);
  }
  std::lock_guard lock(mu_);
  for (auto& c : children_) {
    if (c->reaper.joinable()) c->reaper.join();
  }
}

}  // namespace bg::frontend
