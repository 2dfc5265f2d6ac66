// Supervision of the worker set (one `batchgen worker` process per rank): fork/exec, exit and heartbeat checks, and
// restarts. The set is the unit: it is ready when every rank is ready, and when any rank dies, hangs (no heartbeat
// within the deadline) or fails, every rank is stopped, every in-flight request fails with a clear 503, and the
// whole set is started again after an exponential backoff. Too many restarts in a row (a crash loop) end with
// /ready false and /health 503. A failure before the set was ever ready is reported to `serve`, which exits with it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace bg::frontend {

class WorkerLink;

struct SupervisorConfig {
  std::chrono::milliseconds heartbeat_timeout{60'000};  // no status or token event for this long: hung
  int max_restarts = 5;                                  // restarts in a row before giving up
  std::chrono::milliseconds backoff_initial{1'000};      // delay before restart k: initial * 2^(k-1), capped
  std::chrono::milliseconds backoff_max{30'000};
  std::chrono::milliseconds stable_after{60'000};        // ready this long: the restart streak starts over
  std::chrono::milliseconds tick{100};                   // how often the supervisor looks
};

// Rank r's command line (argv[0] = the executable) for a process with routing id `identity`.
using WorkerCommand = std::function<std::vector<std::string>(int32_t rank, const std::string& identity)>;

class WorkerManager {
 public:
  enum class Phase { starting, serving, restarting, gave_up, failed_at_start, stopped };

  WorkerManager(WorkerLink& link, int32_t n_ranks, WorkerCommand command, SupervisorConfig cfg = {});
  ~WorkerManager();
  WorkerManager(const WorkerManager&) = delete;
  WorkerManager& operator=(const WorkerManager&) = delete;

  // Starts the supervisor thread, which spawns the set, and returns once it has. The children get
  // PR_SET_PDEATHSIG(SIGTERM), tied to the thread that forks them: the supervisor thread lives until stop().
  void start();
  // Asks every rank to shut down ("shutdown" message), waits up to `grace`, then SIGKILLs what is left; reaps all.
  void stop(std::chrono::milliseconds grace);

  Phase phase() const;
  // Why the set failed before it was ever ready (failed_at_start) or why the supervisor gave up.
  std::string failure() const;
  // Waits up to `timeout` for the phase to change from `from`; returns the current phase.
  Phase wait_change(Phase from, std::chrono::milliseconds timeout) const;

 private:
  struct Child {
    int32_t rank = 0;
    pid_t pid = -1;
    bool exited = false;
    int wait_status = 0;
    std::chrono::steady_clock::time_point spawned;
  };

  void run();
  void spawn_set();
  pid_t spawn(int32_t rank, const std::string& identity);
  void reap_nonblocking();
  std::string find_failure(int32_t& rank);
  void on_failure(int32_t rank, const std::string& failure);
  void kill_set();
  void shutdown_set();
  void set_phase(Phase p);

  WorkerLink& link_;
  const int32_t n_ranks_;
  WorkerCommand command_;
  SupervisorConfig cfg_;
  std::thread thread_;
  std::atomic<bool> stop_requested_{false};
  std::chrono::milliseconds stop_grace_{10'000};

  mutable std::mutex mu_;                 // guards phase_ and failure_
  mutable std::condition_variable cv_;
  Phase phase_ = Phase::starting;
  std::string failure_;
  bool first_spawn_done_ = false;

  // Supervisor thread only.
  std::vector<Child> children_;
  int64_t incarnation_ = 0;
  bool ever_ready_ = false;
  int streak_ = 0;                        // restarts since the set was last ready for stable_after
  std::chrono::steady_clock::time_point ready_since_;
  std::chrono::steady_clock::time_point restart_at_;
};

// "exited with status 1" / "killed by signal 9 (Killed)" from a waitpid status.
std::string describe_exit(int wait_status);

}  // namespace bg::frontend
