// fork/exec, reaping, signalling and restarting of worker processes.
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

void WorkerManager::start_set(RankSetSpec spec) {
  BG_CHECK(spec.n_ranks >= 1 && spec.command, "worker manager: an empty rank set");
  spec_ = std::move(spec);
  spawn_generation();
  if (spec_.restart) supervisor_ = std::thread([this] { supervise(); });
}

void WorkerManager::spawn_generation() {
  if (spec_.on_generation) spec_.on_generation(generation_);
  for (int32_t r = spec_.first_rank; r < spec_.first_rank + spec_.n_ranks; ++r) spawn(r, spec_.command(r, generation_));
}

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
  child->generation = generation_;
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
  std::string reason = why;
  {
    std::lock_guard lock(mu_);
    if (stopping_) {
      log::info("frontend: rank {} (pid {}) stopped: {}", child.rank, child.pid, why);
    } else if (set_failed_ && child.generation == generation_) {
      // Stopped by the restart of the set (or failing with it): name the rank that started it.
      log::info("frontend: rank {} (pid {}) stopped with its rank set: {}", child.rank, child.pid, why);
      reason = fmt::format("{} (the rank set is restarting: {})", why, failure_);
    } else {
      log::error("frontend: rank {} (pid {}): {}", child.rank, child.pid, why);
      if (!set_failed_ && child.generation == generation_) {
        set_failed_ = true;
        failure_ = fmt::format("rank {}: {}", child.rank, why);
      }
    }
  }
  cv_.notify_all();
  if (child.generation == generation_) link_.mark_exited(child.rank, reason);
}

// Waits for a failed generation, stops what is left of it, waits out the backoff and starts the next generation.
void WorkerManager::supervise() {
  auto backoff = spec_.initial_backoff;
  auto started = std::chrono::steady_clock::now();
  std::unique_lock lock(mu_);
  while (!stopping_) {
    cv_.wait(lock, [&] { return stopping_ || set_failed_; });
    if (stopping_) return;
    if (std::chrono::steady_clock::now() - started >= spec_.stable_after) backoff = spec_.initial_backoff;
    log::warn("frontend: the rank set failed ({}); stopping its other ranks and restarting it in {} ms", failure_,
              backoff.count());
    lock.unlock();
    terminate_children(std::chrono::milliseconds(5000));
    lock.lock();
    if (cv_.wait_for(lock, backoff, [&] { return stopping_.load(); })) return;
    backoff = std::min(backoff * 2, spec_.max_backoff);
    ++generation_;
    set_failed_ = false;
    lock.unlock();
    link_.reset_ranks();
    log::info("frontend: starting generation {} of the rank set", generation_.load());
    try {
      spawn_generation();
    } catch (const std::exception& e) {
      log::error("frontend: restarting the rank set failed: {}", e.what());
    }
    started = std::chrono::steady_clock::now();
    lock.lock();
  }
}

void WorkerManager::terminate_children(std::chrono::milliseconds grace) {
  signal_all(SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (any_alive() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (any_alive()) {
    log::warn("frontend: workers did not exit within {} ms; killing them", grace.count());
    signal_all(SIGKILL);
  }
  // Reapers take mu_ after they set `exited`: join them without holding it.
  std::vector<std::unique_ptr<Child>> done;
  {
    std::lock_guard lock(mu_);
    for (auto it = children_.begin(); it != children_.end();) {
      if ((*it)->exited) {
        done.push_back(std::move(*it));
        it = children_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : done) {
    if (c->reaper.joinable()) c->reaper.join();
  }
}

void WorkerManager::signal_all(int sig) {
  std::lock_guard lock(mu_);
  for (const auto& c : children_) {
    if (!c->exited) kill(c->pid, sig);
  }
}

void WorkerManager::forward_shutdown_signal(int sig) {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
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
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (supervisor_.joinable()) supervisor_.join();
  signal_all(SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (any_alive() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (any_alive()) {
    log::warn("frontend: workers did not exit within {} ms; killing them", grace.count());
    signal_all(SIGKILL);
  }
  std::vector<std::unique_ptr<Child>> all;
  {
    std::lock_guard lock(mu_);
    all.swap(children_);
  }
  for (auto& c : all) {
    if (c->reaper.joinable()) c->reaper.join();
  }
}

}  // namespace bg::frontend
