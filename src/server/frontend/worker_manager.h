// Worker processes: the ranks of a set that run on this host (fork/exec of `batchgen worker`), a reaper thread per
// child that reports exits to the WorkerLink, signal forwarding, restarting the set when a rank dies, and a shutdown
// that never leaves a child behind (SIGTERM, grace, SIGKILL, reap).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace bg::frontend {

class WorkerLink;

// The ranks this host runs, and how to (re)start them.
struct RankSetSpec {
  int32_t first_rank = 0;
  int32_t n_ranks = 1;
  // A rank's command line (argv[0] = the executable) for a generation of the set (0, 1, ... after each restart).
  std::function<std::vector<std::string>(int32_t rank, int64_t generation)> command;
  // Runs before a generation starts (a fresh rendezvous); may be empty.
  std::function<void(int64_t generation)> on_generation;
  // A rank that exits unexpectedly stops the whole set (its peers cannot step without it), which starts again after
  // a backoff: initial_backoff, doubling up to max_backoff, back to initial once a generation ran for stable_after.
  bool restart = true;
  std::chrono::milliseconds initial_backoff{2000};
  std::chrono::milliseconds max_backoff{30000};
  std::chrono::milliseconds stable_after{60000};
};

class WorkerManager {
 public:
  explicit WorkerManager(WorkerLink& link);
  ~WorkerManager();
  WorkerManager(const WorkerManager&) = delete;
  WorkerManager& operator=(const WorkerManager&) = delete;

  // Starts generation 0 of the set and (with restart) a supervisor thread that restarts it. The children get
  // PR_SET_PDEATHSIG(SIGTERM), which fires when the *forking thread* exits: call this from a thread that lives as
  // long as the server (main); restarts fork from the supervisor thread, which lives as long as this object.
  void start_set(RankSetSpec spec);
  // Starts `argv` (argv[0] = the executable path) as `rank`'s process (not restarted).
  void spawn(int32_t rank, const std::vector<std::string>& argv);
  // Forwards a signal to every live child.
  void signal_all(int sig);
  // A shutdown signal: from now on exits are expected (logged as info), then the signal goes to every child.
  void forward_shutdown_signal(int sig);
  // SIGTERM to every live child, up to `grace` for them to exit, then SIGKILL; joins the reapers and the supervisor.
  void stop(std::chrono::milliseconds grace);
  bool any_alive() const;
  int64_t generation() const { return generation_; }

 private:
  struct Child {
    int32_t rank = 0;
    pid_t pid = -1;
    int64_t generation = 0;
    std::atomic<bool> exited{false};
    std::thread reaper;
  };
  void reap(Child& child);
  void supervise();
  void spawn_generation();
  void terminate_children(std::chrono::milliseconds grace);

  WorkerLink& link_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> generation_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Child>> children_;
  RankSetSpec spec_;
  bool set_failed_ = false;      // guarded by mu_: a rank of the current generation exited unexpectedly
  std::string failure_;          // which rank, and how
  std::thread supervisor_;
};

// "exited with status 1" / "killed by signal 9 (Killed)" from a waitpid status.
std::string describe_exit(int wait_status);

}  // namespace bg::frontend
