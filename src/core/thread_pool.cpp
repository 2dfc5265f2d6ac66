// ThreadPool: chunks are handed out under one mutex; tiny reference workloads need nothing fancier.
#include "core/thread_pool.h"

#include <algorithm>
#include <optional>
#include <string>

#include "core/env.h"

namespace bg {
namespace {
thread_local bool t_inside_job = false;
}

ThreadPool::ThreadPool(int n_threads) {
  for (int i = 1; i < std::max(1, n_threads); ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  int64_t max_chunks = std::max<int64_t>(1, n / grain);
  int64_t n_chunks = std::min<int64_t>(max_chunks, int64_t{n_threads()} * 4);
  if (n_chunks <= 1 || workers_.empty() || t_inside_job) {
    fn(0, n);
    return;
  }
  std::lock_guard turn(callers_);
  std::unique_lock lock(mutex_);
  job_ = &fn;
  job_n_ = n;
  job_chunk_ = (n + n_chunks - 1) / n_chunks;
  next_chunk_begin_ = 0;
  ++generation_;
  work_cv_.notify_all();
  // The caller takes chunks as well.
  t_inside_job = true;
  while (next_chunk_begin_ < job_n_) {
    int64_t begin = next_chunk_begin_;
    int64_t end = std::min(job_n_, begin + job_chunk_);
    next_chunk_begin_ = end;
    ++n_active_;
    lock.unlock();
    fn(begin, end);
    lock.lock();
    --n_active_;
  }
  t_inside_job = false;
  done_cv_.wait(lock, [this] { return n_active_ == 0; });
  job_ = nullptr;
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  std::unique_lock lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || (generation_ != seen && job_ != nullptr); });
    if (stop_) return;
    seen = generation_;
    while (job_ != nullptr && next_chunk_begin_ < job_n_) {
      int64_t begin = next_chunk_begin_;
      int64_t end = std::min(job_n_, begin + job_chunk_);
      next_chunk_begin_ = end;
      ++n_active_;
      const auto* fn = job_;
      lock.unlock();
      t_inside_job = true;
      (*fn)(begin, end);
      t_inside_job = false;
      lock.lock();
      --n_active_;
    }
    if (n_active_ == 0) done_cv_.notify_all();
  }
}

ThreadPool& default_pool() {
  static ThreadPool pool([] {
    if (const std::optional<int64_t> n = env_int("BG_NUM_THREADS", 1, 4096)) return static_cast<int>(*n);
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }());
  return pool;
}

}  // namespace bg
