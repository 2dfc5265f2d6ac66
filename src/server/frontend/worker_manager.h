// Worker processes: fork/exec of `batchgen worker` per rank, a reaper thread per child that reports exits to the
// WorkerLink, signal forwarding, and a shutdown that never leaves a child behind (SIGTERM, grace, SIGKILL, reap).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace bg::frontend {

class WorkerLink;

class WorkerManager {
 public:
  explicit WorkerManager(WorkerLink& link);
  ~WorkerManager();
  WorkerManager(const WorkerManager&) = delete;
  WorkerManager& operator=(const WorkerManager&) = delete;

  // Starts `argv` (argv[0] = the executable path) as `rank`'s process. The child gets PR_SET_PDEATHSIG(SIGTERM),
  // which fires when the *calling thread* exits: call this from a thread that lives as long as the server (main).
  void spawn(int32_t rank, const std::vector<std::string>& argv);
  // Forwards a signal to every live child.
  void signal_all(int sig);
  // A shutdown signal: from now on exits are expected (logged as info), then the signal goes to every child.
  void forward_shutdown_signal(int sig);
  // SIGTERM to every live child, up to `grace` for them to exit, then SIGKILL; joins the reapers.
  void stop(std::chrono::milliseconds grace);
  bool any_alive() const;

 private:
  struct Child {
    int32_t rank = 0;
    pid_t pid = -1;
    std::atomic<bool> exited{false};
    std::thread reaper;
  };
  void reap(Child& child);

  WorkerLink& link_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Child>> children_;
};

// "exited with status 1" / "killed by signal 9 (Killed)" from a waitpid status.
std::string describe_exit(int wait_status);

}  // namespace bg::frontend
