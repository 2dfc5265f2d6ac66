// The shared memory of a CPU rank set on one host: POSIX shm segments (shm_open + mmap) and the set's control block
// (each rank's pid, the failed word), plus the wait every collective and exchange uses: spin briefly, then sleep on
// a futex (cross-process), and between sleeps check that every peer process is alive and the set has not failed, so
// a dead rank turns into RankFailure within ~100 ms instead of a hang.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dist/comm.h"
#include "dist/parallel_layout.h"

namespace bg::dist {

// One mapped POSIX shm segment; unmapped when destroyed. The name is removed by unlink() (the creator does that once
// every rank has attached, so a crash leaves nothing behind in /dev/shm) or, at the latest, when the creator's object
// is destroyed.
class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(ShmSegment&& o) noexcept;
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Creates `name` ("/batchgen-...") of `bytes` (zero-filled) and maps it; throws if it exists.
  static ShmSegment create(const std::string& name, size_t bytes);
  // Maps an existing segment; throws unless it holds exactly `bytes`.
  static ShmSegment open(const std::string& name, size_t bytes);
  void unlink();

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  bool linked_ = false;
};

// A fresh segment name: "/batchgen-<what>-<pid>-<random hex>".
std::string unique_shm_name(const std::string& what);

// 32-bit words that other processes wait on: release store + futex wake; acquire load.
void store_and_wake(uint32_t* word, uint32_t value);
// Increments a doorbell word (a wake-up only: waiters re-check their own condition) and wakes its waiters.
void bump_and_wake(uint32_t* word);
uint32_t load_acquire(const uint32_t* word);

// The set's control block at the start of the comm segment.
struct ShmControl {
  uint64_t magic;
  int32_t world;
  uint32_t n_attached;             // futex word: ranks that have mapped the segment
  uint32_t failed;                 // futex word: 0 healthy, else 1 + the first rank that failed
  int32_t pids[kMaxRanks];         // each rank's pid (0 before it attached)
  char reason[512];                // why the set failed (first writer wins)
};

// The rank set as this process sees it: the control block and the waits.
class ShmSet {
 public:
  // `control` points into a mapped segment that outlives this object.
  ShmSet(ShmControl* control, int32_t world, int32_t rank, double timeout_s);

  int32_t world() const { return world_; }
  int32_t rank() const { return rank_; }
  // Registers this rank (pid) and waits until every rank has; throws RankFailure on timeout.
  void attach_and_wait();
  // Waits until done() (re-evaluated after each wake of `word` or every 20 ms); throws RankFailure when the set
  // failed, a peer process is gone, or timeout_s passed. `what` names the wait in the message.
  void wait(const uint32_t* word, const std::function<bool()>& done, const char* what) const;
  // Records the failure (first reason wins) and wakes every waiter; never throws.
  void mark_failed(int32_t rank, const std::string& reason) const;
  // Throws RankFailure if the set has failed or a peer is gone (cheap; called between waits).
  void check_peers() const;

 private:
  [[noreturn]] void fail_wait(const char* what, const std::string& why) const;
  ShmControl* c_;
  int32_t world_, rank_;
  double timeout_s_;
};

}  // namespace bg::dist
