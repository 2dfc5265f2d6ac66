// The supervisor thread: spawns the worker set, watches exits (waitpid), heartbeats and failed statuses through the
// WorkerLink, and restarts the set with backoff; stop() shuts the set down and reaps every child.
#include "server/frontend/worker_manager.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/device_fault.h"
#include "core/error.h"
#include "core/log.h"
#include "core/spawn.h"
#include "server/frontend/worker_link.h"

namespace bg::frontend {

using Clock = std::chrono::steady_clock;

namespace {

constexpr std::chrono::milliseconds kReapWait{10'000};  // longest wait for a SIGKILLed child to be reaped
// A rank that reported "failed" (a device fault) is exiting by itself after its last events: this long for its exit
// status before it is killed.
constexpr std::chrono::milliseconds kFailedExitGrace{3'000};

double seconds(std::chrono::milliseconds d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

std::string describe_exit(int wait_status) {
  if (WIFEXITED(wait_status)) {
    if (WEXITSTATUS(wait_status) == 127) return "the worker could not be started (exec failed)";
    if (WEXITSTATUS(wait_status) == kExitDeviceFault) {
      return fmt::format("the worker process exited with status {} (a device fault: its GPU context was lost)",
                         kExitDeviceFault);
    }
    return fmt::format("the worker process exited with status {}", WEXITSTATUS(wait_status));
  }
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    return fmt::format("the worker process was killed by signal {} ({})", sig, strsignal(sig));
  }
  return fmt::format("the worker process ended (wait status {})", wait_status);
}

WorkerManager::WorkerManager(WorkerLink& link, int32_t n_ranks, WorkerCommand command, SupervisorConfig cfg,
                             RemoteRanks* remote)
    : link_(link), n_ranks_(n_ranks), command_(std::move(command)), cfg_(cfg), remote_(remote) {
  BG_CHECK(n_ranks >= 1, "worker manager: n_ranks {} must be >= 1", n_ranks);
  BG_CHECK(cfg.max_restarts >= 0, "--max-worker-restarts {} must be >= 0", cfg.max_restarts);
  link_.set_heartbeat_timeout(cfg.heartbeat_timeout);
}

WorkerManager::~WorkerManager() { stop(std::chrono::milliseconds(2000)); }

void WorkerManager::start() {
  BG_CHECK(!thread_.joinable(), "worker manager: started twice");
  thread_ = std::thread([this] { run(); });
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return first_spawn_done_; });
}

void WorkerManager::stop(std::chrono::milliseconds grace) {
  stop_grace_ = grace;
  stop_requested_ = true;
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

WorkerManager::Phase WorkerManager::phase() const {
  std::lock_guard lock(mu_);
  return phase_;
}

std::string WorkerManager::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

WorkerManager::Phase WorkerManager::wait_change(Phase from, std::chrono::milliseconds timeout) const {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return phase_ != from; });
  return phase_;
}

void WorkerManager::set_phase(Phase p) {
  {
    std::lock_guard lock(mu_);
    phase_ = p;
  }
  cv_.notify_all();
}

pid_t WorkerManager::spawn(int32_t rank, const std::string& identity) {
  const std::vector<std::string> argv = command_(rank, identity);
  BG_CHECK(!argv.empty(), "worker manager: empty command line for rank {}", rank);
  link_.begin_incarnation(rank, identity, 0);  // before fork: the child's first status must find its identity
  // Its own process group: a terminal's Ctrl-C reaches the frontend, which drains, not the worker. SIGPIPE back to
  // its default (the frontend ignores it); the frontend blocks SIGINT/SIGTERM for its signal handling, the child not.
  const pid_t pid = spawn_child(argv, SpawnOptions{.own_process_group = true, .default_sigpipe = true});
  link_.set_pid(rank, pid);
  log::info("frontend: started rank {} (pid {}): {}", rank, pid, fmt::join(argv, " "));
  return pid;
}

void WorkerManager::spawn_set() {
  ++incarnation_;
  children_.clear();
  std::vector<std::string> identities;
  for (int32_t r = 0; r < n_ranks_; ++r) {
    Child c;
    c.rank = r;
    c.spawned = Clock::now();
    identities.push_back(fmt::format("rank-{}-i{}{}", r, incarnation_, cfg_.identity_suffix));
    if (remote_ != nullptr && remote_->is_remote(r)) {
      c.remote = true;
      link_.begin_incarnation(r, identities.back(), 0);  // its agent starts it; pid reported later
    } else {
      c.pid = spawn(r, identities.back());
    }
    children_.push_back(c);
  }
  if (remote_ != nullptr) {
    remote_->start(incarnation_, identities);  // after rank 0: its command line bound this incarnation's rendezvous
    log::info("frontend: incarnation {}: the other nodes' agents were asked for their ranks", incarnation_);
  }
}

// What the remote rank's agent has reported: its pid, that it started (the heartbeat deadline counts from then), that
// it was reaped; while its node has no agent, /ready says so.
void WorkerManager::poll_remote(Child& c) {
  if (c.exited) return;
  const RemoteRank st = remote_->state(c.rank, incarnation_);
  if (st.pid != 0 && st.pid != c.pid) {
    c.pid = static_cast<pid_t>(st.pid);
    link_.set_pid(c.rank, st.pid);
    log::info("frontend: {} started (pid {} there)", rank_name(c.rank), st.pid);
  }
  if (st.started && !c.remote_started) {
    c.remote_started = true;
    link_.restart_clock(c.rank);
  }
  const std::string note = st.started ? "" : st.waiting;
  if (note != c.waiting_note) {
    c.waiting_note = note;
    link_.set_supervisor_note(c.rank, note, false);
  }
  if (st.exited) {
    c.exited = true;
    c.wait_status = st.wait_status;
  }
}

std::string WorkerManager::rank_name(int32_t rank) const {
  return remote_ == nullptr ? fmt::format("rank {}", rank) : fmt::format("rank {} (node {})", rank,
                                                                         remote_->node_of(rank));
}

void WorkerManager::reap_nonblocking() {
  for (Child& c : children_) {
    if (c.remote) poll_remote(c);
    if (c.exited || c.remote) continue;
    int status = 0;
    const pid_t got = waitpid(c.pid, &status, WNOHANG);
    if (got == c.pid) {
      c.exited = true;
      c.wait_status = status;
    }
  }
}

// The first rank that is gone, hung or failed, with why ("" when the set is healthy). What took a process or a node
// away comes first (a rank killed by a signal, a node whose agent is gone): the ranks that then failed on the dead
// peer would otherwise be named instead of the cause; so does a node that never came (the ranks waiting for it time
// out too).
std::string WorkerManager::find_failure(int32_t& rank) {
  const auto now = Clock::now();
  for (const Child& c : children_) {
    rank = c.rank;
    if (c.exited && WIFSIGNALED(c.wait_status)) return describe_exit(c.wait_status);
    if (c.remote && !c.exited) {
      const RemoteRank st = remote_->state(c.rank, incarnation_);
      if (!st.node_gone.empty()) return st.node_gone;
      if (std::string why = remote_failure(c, st, now); !why.empty()) return why;  // a node that never came
    }
  }
  const std::vector<RankState> states = link_.ranks();
  for (Child& c : children_) {
    const RankState& s = states[static_cast<size_t>(c.rank)];
    rank = c.rank;
    if (c.exited) {
      std::string why = describe_exit(c.wait_status);
      if (s.status.phase == "failed" && !s.status.error.empty()) why = s.status.error + " (" + why + ")";
      return why;
    }
    if (c.remote && !c.remote_started) continue;  // not started yet (the first pass minds the timeout)
    if (s.status.phase == "failed") {
      const std::string why = s.status.error.empty() ? "failed while loading" : s.status.error;
      return wait_exit(c, kFailedExitGrace) ? why + " (" + describe_exit(c.wait_status) + ")" : why;
    }
    if (!s.heartbeat_ok()) {
      return s.connected ? fmt::format("stopped responding (no heartbeat for {:.1f} s; --worker-heartbeat-timeout "
                                       "{:.1f} s)", s.status_age_s, seconds(cfg_.heartbeat_timeout))
                         : fmt::format("did not connect within {:.1f} s (--worker-heartbeat-timeout)",
                                       seconds(cfg_.heartbeat_timeout));
    }
  }
  return "";
}

// A remote rank whose node's agent has not got its start: a failure once the node join timeout has passed.
std::string WorkerManager::remote_failure(const Child& c, const RemoteRank& st, Clock::time_point now) const {
  if (st.started || now - c.spawned < cfg_.node_join_timeout) return "";
  return fmt::format("{} for {:.1f} s (BG_RANK_TIMEOUT_S)", st.waiting.empty() ? "its node never started it"
                                                                                 : st.waiting,
                     seconds(cfg_.node_join_timeout));
}

// Waits up to `limit` for the child to exit by itself; true when it has (its status is then in wait_status).
bool WorkerManager::wait_exit(Child& c, std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  while (!c.exited) {
    int status = 0;
    if (c.remote) {
      poll_remote(c);
      if (c.exited) break;
    } else if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
      c.exited = true;
      c.wait_status = status;
      break;
    }
    if (Clock::now() > deadline || stop_requested_) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// SIGKILL to every rank still running (their state is lost with the failed rank's), reaped before returning.
void WorkerManager::kill_set() {
  for (Child& c : children_) {
    if (!c.exited && !c.remote) kill(c.pid, SIGKILL);
  }
  if (remote_ != nullptr) kill_remote();
  const auto deadline = Clock::now() + kReapWait;
  for (Child& c : children_) {
    while (!c.exited && !c.remote) {
      int status = 0;
      const pid_t got = waitpid(c.pid, &status, WNOHANG);
      if (got == c.pid || (got < 0 && errno == ECHILD)) {
        c.exited = true;
        c.wait_status = status;
      } else if (Clock::now() > deadline) {
        log::error("frontend: rank {} (pid {}) was not reaped {} s after SIGKILL", c.rank, c.pid,
                   seconds(kReapWait));
        break;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  }
}

// The remote ranks through their agents: SIGKILL, then their reaping reported back (bounded). A rank whose agent is
// gone went with it (the agent's children die with it); one whose agent never got the start never ran.
void WorkerManager::kill_remote() {
  bool any = false;
  for (const Child& c : children_) any = any || (c.remote && !c.exited);
  if (!any) return;
  remote_->kill(incarnation_);
  const auto deadline = Clock::now() + kReapWait;
  for (Child& c : children_) {
    while (c.remote && !c.exited) {
      poll_remote(c);
      const RemoteRank st = remote_->state(c.rank, incarnation_);
      if (c.exited) break;
      if (!st.started || !st.node_gone.empty()) {
        c.exited = true;
        c.never_started = !st.started;
        c.wait_status = SIGKILL;  // gone with its agent, or never run: recorded as killed
        break;
      }
      if (Clock::now() > deadline) {
        log::error("frontend: {} was not reported reaped by its node's agent {} s after the kill", rank_name(c.rank),
                   seconds(kReapWait));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

void WorkerManager::on_failure(int32_t rank, const std::string& failure) {
  kill_set();
  for (const Child& c : children_) {
    link_.mark_exited(c.rank, c.rank == rank ? failure : fmt::format("stopped with the worker set ({} {})",
                                                                    rank_name(rank), failure));
  }
  const std::string what = fmt::format("{}: {}", rank_name(rank), failure);
  if (!ever_ready_) {
    log::error("frontend: {} (before the worker set was ready)", what);
    {
      std::lock_guard lock(mu_);
      failure_ = what;
    }
    set_phase(Phase::failed_at_start);
    return;
  }
  if (streak_ >= cfg_.max_restarts) {
    const std::string note = fmt::format("gave up after {} restarts in a row (--max-worker-restarts); restart "
                                         "batchgen serve once the cause is fixed", streak_);
    log::error("frontend: {}; {}", what, note);
    for (int32_t r = 0; r < n_ranks_; ++r) link_.set_supervisor_note(r, note, /*gave_up=*/true);
    {
      std::lock_guard lock(mu_);
      failure_ = what + "; " + note;
    }
    set_phase(Phase::gave_up);
    return;
  }
  ++streak_;
  const auto factor = int64_t{1} << std::min(streak_ - 1, 20);
  const auto delay = std::min(cfg_.backoff_initial * factor, cfg_.backoff_max);
  restart_at_ = Clock::now() + delay;
  link_.count_restart();
  const std::string note = fmt::format("restarting the worker set in {:.1f} s (restart {} of at most {} in a row)",
                                       seconds(delay), streak_, cfg_.max_restarts);
  log::error("frontend: {}; {}", what, note);
  for (int32_t r = 0; r < n_ranks_; ++r) link_.set_supervisor_note(r, note, /*gave_up=*/false);
  set_phase(Phase::restarting);
}

void WorkerManager::shutdown_set() {
  bool any = false;
  for (const Child& c : children_) any = any || !c.exited;
  if (any) {
    link_.shutdown_workers();
    const auto deadline = Clock::now() + stop_grace_;
    while (Clock::now() < deadline) {
      reap_nonblocking();
      bool alive = false;  // a remote rank whose agent never got its start is not waited for
      for (const Child& c : children_) alive = alive || (!c.exited && (!c.remote || c.remote_started));
      if (!alive) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    for (const Child& c : children_) {
      if (!c.exited && (!c.remote || c.remote_started)) {
        log::warn("frontend: {} (pid {}) did not exit within {:.1f} s; killing it", rank_name(c.rank), c.pid,
                  seconds(stop_grace_));
      }
    }
    kill_set();
  }
  for (const Child& c : children_) {
    if (c.never_started) {
      log::info("frontend: {} never started (its node had no agent)", rank_name(c.rank));
    } else {
      log::info("frontend: {} (pid {}) stopped: {}", rank_name(c.rank), c.pid, describe_exit(c.wait_status));
    }
    link_.mark_exited(c.rank, "the server is shutting down");
  }
  children_.clear();
}

void WorkerManager::run() {
  try {
    spawn_set();
  } catch (const std::exception& e) {
    {
      std::lock_guard lock(mu_);
      failure_ = e.what();
    }
    set_phase(Phase::failed_at_start);
  }
  {
    std::lock_guard lock(mu_);
    first_spawn_done_ = true;
  }
  cv_.notify_all();
  while (!stop_requested_) {
    {
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, cfg_.tick, [&] { return stop_requested_.load(); });
    }
    if (stop_requested_) break;
    reap_nonblocking();
    const Phase p = phase();
    const auto now = Clock::now();
    if (p == Phase::gave_up || p == Phase::failed_at_start) continue;
    if (p == Phase::restarting) {
      if (now >= restart_at_) {
        log::info("frontend: restarting the worker set");
        spawn_set();
        set_phase(Phase::starting);
      }
      continue;
    }
    int32_t rank = 0;
    std::string failure = find_failure(rank);
    if (!failure.empty() && remote_ != nullptr) {
      // Across nodes the cause may be reported a moment after its effect (a dead peer seen by a local rank before
      // the remote agent's report of the death): let the reports arrive, then look again.
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      reap_nonblocking();
      int32_t again_rank = rank;
      if (std::string again = find_failure(again_rank); !again.empty()) {
        failure = std::move(again);
        rank = again_rank;
      }
    }
    if (!failure.empty()) {
      on_failure(rank, failure);
      continue;
    }
    if (!link_.all_ready()) continue;
    if (p != Phase::serving) {
      if (ever_ready_) log::info("frontend: the worker set is serving again");
      ever_ready_ = true;
      ready_since_ = now;
      for (int32_t r = 0; r < n_ranks_; ++r) link_.set_supervisor_note(r, "", false);
      set_phase(Phase::serving);
    } else if (streak_ > 0 && now - ready_since_ >= cfg_.stable_after) {
      streak_ = 0;
    }
  }
  shutdown_set();
  set_phase(Phase::stopped);
}

}  // namespace bg::frontend
