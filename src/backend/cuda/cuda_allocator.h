// A caching device allocator with a byte budget: freed blocks go back to per-size free lists instead of cudaFree
// (which synchronises the device), so per-step activations cost no driver calls after warm-up.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace bg::cuda {

class CachingAllocator : public std::enable_shared_from_this<CachingAllocator> {
 public:
  // budget_bytes: the most device memory this allocator may hold (cached + in use); 0 = all free memory at start.
  explicit CachingAllocator(size_t budget_bytes);
  ~CachingAllocator();

  // A device block of at least `bytes`, released back to the cache when the last owner drops it. Throws bg::Error
  // naming the request and the budget when it cannot be satisfied even after releasing the cache.
  std::shared_ptr<void> allocate(size_t bytes);
  size_t bytes_in_use() const;
  size_t bytes_cached() const;
  size_t budget_bytes() const { return budget_; }
  // Returns every cached block to the driver.
  void release_cache();
  // While a sink is set (CUDA graph capture), every block handed out is also kept in it, so the memory a captured
  // graph uses is never reused by anything else while the graph lives. nullptr ends it.
  void set_capture_sink(std::vector<std::shared_ptr<void>>* sink);

 private:
  static size_t round_size(size_t bytes);
  void give_back(void* ptr, size_t size);

  mutable std::mutex mutex_;
  size_t budget_ = 0;
  size_t in_use_ = 0;
  size_t cached_ = 0;
  std::multimap<size_t, void*> free_;  // size -> block
  std::vector<std::shared_ptr<void>>* sink_ = nullptr;
};

}  // namespace bg::cuda
