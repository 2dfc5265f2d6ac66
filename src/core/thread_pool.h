// A fixed pool of worker threads and parallel_for over index ranges (the CPU backend's only threading).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace bg {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int n_threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(begin, end) over [0, n) split into contiguous chunks of at least `grain`; the caller's thread works too.
  // Blocks until every chunk is done. Not reentrant: a nested call runs inline. Calls from several threads (ranks run
  // as threads in tests) take turns.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex callers_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int64_t job_chunk_ = 0;
  int64_t next_chunk_begin_ = 0;
  int n_active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// The process-wide pool (BG_NUM_THREADS or the hardware concurrency).
ThreadPool& default_pool();

inline void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  default_pool().parallel_for(n, grain, fn);
}

}  // namespace bg
