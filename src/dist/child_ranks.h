// The child rank processes of a single-process CLI (`score`, `generate` with several ranks): this process is rank 0,
// ranks 1.. are `batchgen rank ...` children (fork/exec, PR_SET_PDEATHSIG so they die with it). Never leaves one
// behind: wait_all gives them a grace period to exit, then SIGTERM, then SIGKILL, and reaps every one.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace bg::dist {

class ChildRanks {
 public:
  ChildRanks() = default;
  ~ChildRanks();
  ChildRanks(const ChildRanks&) = delete;
  ChildRanks& operator=(const ChildRanks&) = delete;

  void spawn(int32_t rank, const std::vector<std::string>& argv);
  // Waits up to `grace` for every child to exit by itself, then terminates the rest. True when every child exited
  // with status 0 (failures() says which did not).
  bool wait_all(std::chrono::milliseconds grace);
  std::string failures() const;
  // Reaps children that have exited (without waiting); true if any has.
  bool any_exited();
  // After any_exited(): true when every child has exited / when some child exited other than with status 0.
  bool all_exited() const;
  bool any_failed() const;
  std::vector<pid_t> pids() const;

 private:
  struct Child {
    int32_t rank = 0;
    pid_t pid = -1;
    bool reaped = false;
    int status = 0;
  };
  std::vector<Child> children_;
};

}  // namespace bg::dist
