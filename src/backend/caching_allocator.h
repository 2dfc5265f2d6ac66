// CachingAllocator: a caching device-memory allocator with a byte budget over a BlockDriver (CUDA: cudaMalloc /
// cudaFree), and the private memory pools of captured CUDA graphs. CUDA-free, so the CPU tests cover its bookkeeping.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

namespace bg {

// The device calls the allocator makes. malloc returns nullptr when the device is out of memory (the allocator then
// gives its cached blocks back and asks once more) and throws bg::Error on any other failure.
class BlockDriver {
 public:
  virtual ~BlockDriver() = default;
  virtual void* malloc(size_t bytes) = 0;
  virtual void free(void* ptr) noexcept = 0;
};

class CachingAllocator;

// The memory of one captured graph: every block handed out while it was being captured. Blocks freed during the
// capture go back to this pool (not to the shared cache) and are reused by later allocations of the same capture:
// one stream captures, so the reuse is ordered after the freed block's last captured use. The graph holds the pool;
// while it lives nothing outside the graph can get these blocks (the graph reads and writes them at every replay).
// When the pool goes, its blocks return to the allocator's cache (or to the driver when the allocator is gone).
// A pool can also be an arena shared by several graphs that never run at the same time (one stream): a later capture
// reuses the blocks earlier captures freed, so the graphs together hold about the largest one's peak, not the sum.
// That is safe for memory a graph uses within a replay; a block that must keep its contents between replays may not
// come from the arena's freed blocks (another graph writes them): such buffers take allocate_persistent, and
// end_capture names any block taken from the freed blocks that outlives the capture.
class CapturePool {
 public:
  ~CapturePool();
  CapturePool(const CapturePool&) = delete;
  CapturePool& operator=(const CapturePool&) = delete;
  size_t bytes() const;     // bytes of every block the pool owns (held by tensors or free in it)
  size_t n_blocks() const;  // blocks the pool owns

 private:
  friend class CachingAllocator;
  CapturePool(std::weak_ptr<CachingAllocator> alloc, std::shared_ptr<BlockDriver> driver)
      : alloc_(std::move(alloc)), driver_(std::move(driver)) {}

  std::weak_ptr<CachingAllocator> alloc_;
  std::shared_ptr<BlockDriver> driver_;
  // Guarded by the allocator's mutex.
  std::multimap<size_t, void*> free_;  // size -> block freed since it was handed out in this capture
  size_t bytes_ = 0;
  size_t n_blocks_ = 0;
};

class CachingAllocator : public std::enable_shared_from_this<CachingAllocator> {
 public:
  // budget_bytes: the most device memory this allocator may hold (cached + in use), > 0.
  CachingAllocator(std::shared_ptr<BlockDriver> driver, size_t budget_bytes);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A device block of at least `bytes`, released back to the cache (or to the capture pool it was handed out in)
  // when the last owner drops it. Throws bg::Error naming the request and the budget when it cannot be satisfied.
  std::shared_ptr<void> allocate(size_t bytes);
  // The same, but never from a capture's pool even during a capture (the shared cache or the driver, as outside one):
  // for a buffer that lives on after the capture and keeps its contents between replays or steps.
  std::shared_ptr<void> allocate_persistent(size_t bytes);
  size_t bytes_in_use() const;  // handed out, or held by a capture pool
  size_t bytes_cached() const;  // free in the shared cache
  // The most device memory this allocator held at once (in use + cached) since it was made or reset_peak() was
  // last called: what a workload needs of the budget.
  size_t peak_bytes_held() const;
  size_t peak_bytes_in_use() const;  // the most handed out at once over the same span: what a workload needs
  void reset_peak();  // the peaks become what is held / in use now
  size_t budget_bytes() const { return budget_; }
  // Returns every cached block to the driver. During a capture this is deferred to end_capture: cudaFree is illegal
  // while a stream is being captured (it would end the capture with an error).
  void release_cache();

  // Graph capture. Between begin_capture and end_capture: blocks come from the pool first (memory freed earlier in
  // this capture), then from the shared cache, then from the driver (cudaMalloc is allowed while capturing); the
  // driver never frees anything (releases are deferred); at the budget, a larger free block is used instead of
  // returning cached blocks to the driver, and when none is free the allocation fails with bg::Error. One capture at
  // a time. end_capture also runs after a failed capture (the pool is then simply dropped by the caller).
  // `arena`: capture into that pool (one this allocator made, see CapturePool) instead of a new one.
  std::shared_ptr<CapturePool> begin_capture(std::shared_ptr<CapturePool> arena = nullptr);
  // Returns the blocks this capture took from its pool's freed blocks that are still held (not freed back during the
  // capture): with an arena, each is memory other graphs may also use; the caller decides which are allowed (the
  // graph's output, rewritten at every replay) and what to do with the rest.
  std::vector<void*> end_capture();
  bool capturing() const;

 private:
  friend class CapturePool;
  static size_t round_size(size_t bytes);
  std::shared_ptr<void> allocate_impl(size_t bytes, bool persistent);
  void* take_locked(size_t size, size_t& got);
  void* take_capture_locked(size_t size, size_t& got);
  void* driver_malloc_locked(size_t size);
  void release_locked();
  void give_back(void* ptr, size_t size, const std::shared_ptr<CapturePool>& pool);
  void return_pool(CapturePool& pool);

  std::shared_ptr<BlockDriver> driver_;
  mutable std::mutex mutex_;
  size_t budget_ = 0;
  size_t in_use_ = 0;
  size_t cached_ = 0;
  size_t peak_held_ = 0;  // max of in_use_ + cached_
  size_t peak_in_use_ = 0;
  std::multimap<size_t, void*> free_;  // size -> block
  std::shared_ptr<CapturePool> capture_;  // the pool of the capture in progress
  std::set<void*> reused_;                // blocks this capture took from its pool's freed blocks, still held
  bool release_deferred_ = false;         // release_cache was asked for during the capture
};

}  // namespace bg
