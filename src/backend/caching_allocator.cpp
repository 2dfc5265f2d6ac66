// CachingAllocator: size-rounded free lists under one mutex; capture pools; releases deferred past a capture.
#include "backend/caching_allocator.h"

#include <algorithm>

#include "core/error.h"

namespace bg {

CapturePool::~CapturePool() {
  if (auto alloc = alloc_.lock()) {
    alloc->return_pool(*this);
    return;
  }
  for (auto& [size, p] : free_) driver_->free(p);  // the allocator is gone: so is every capture
}

size_t CapturePool::bytes() const {
  auto alloc = alloc_.lock();
  if (!alloc) return bytes_;
  std::lock_guard lock(alloc->mutex_);
  return bytes_;
}

size_t CapturePool::n_blocks() const {
  auto alloc = alloc_.lock();
  if (!alloc) return n_blocks_;
  std::lock_guard lock(alloc->mutex_);
  return n_blocks_;
}

CachingAllocator::CachingAllocator(std::shared_ptr<BlockDriver> driver, size_t budget_bytes)
    : driver_(std::move(driver)), budget_(budget_bytes) {
  BG_CHECK(driver_ != nullptr, "caching allocator: no driver");
  BG_CHECK(budget_ > 0, "caching allocator: the budget must be > 0 bytes");
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard lock(mutex_);
  release_locked();
}

size_t CachingAllocator::round_size(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t{2} << 20;
  if (bytes <= kLarge) {
    size_t s = kSmall;
    while (s < bytes) s *= 2;  // powers of two up to 2 MiB
    return s;
  }
  return (bytes + kLarge - 1) / kLarge * kLarge;  // then 2 MiB granules
}

// Outside a capture: an exact-size cached block, else a new one (the cache goes back to the driver first when the
// new block would not fit the budget).
void* CachingAllocator::take_locked(size_t size, size_t& got) {
  got = size;
  if (auto it = free_.find(size); it != free_.end()) {
    void* ptr = it->second;
    free_.erase(it);
    cached_ -= size;
    return ptr;
  }
  if (in_use_ + cached_ + size > budget_) release_locked();
  BG_CHECK(in_use_ + size <= budget_, "CUDA memory budget exceeded: {} bytes requested with {} in use of a {} byte "
           "budget", size, in_use_, budget_);
  return driver_malloc_locked(size);
}

// A new block from the driver, outside a capture. The budget counts only this allocator's blocks, while the device
// also holds what was allocated around it (weights, libraries, other processes): when the device is out of memory the
// cached blocks go back to it and the request is tried once more.
void* CachingAllocator::driver_malloc_locked(size_t size) {
  void* ptr = driver_->malloc(size);
  if (ptr == nullptr && cached_ > 0) {
    release_locked();
    ptr = driver_->malloc(size);
  }
  BG_CHECK(ptr != nullptr, "CUDA out of memory: {:.1f} MiB requested with {:.1f} MiB in use by this process's "
           "allocator (its cache was given back first)", static_cast<double>(size) / (1 << 20),
           static_cast<double>(in_use_) / (1 << 20));
  return ptr;
}

// During a capture: the pool's own freed blocks, the shared cache, a new block within the budget, and at the budget
// the smallest larger free block (nothing can be returned to the driver until the capture ends).
void* CachingAllocator::take_capture_locked(size_t size, size_t& got) {
  CapturePool& pool = *capture_;
  auto take = [&](std::multimap<size_t, void*>& list, std::multimap<size_t, void*>::iterator it, bool shared) {
    got = it->first;
    void* ptr = it->second;
    list.erase(it);
    if (shared) {
      cached_ -= got;
      in_use_ += got;
      pool.bytes_ += got;
      ++pool.n_blocks_;
    }
    return ptr;
  };
  auto reuse = [&](std::multimap<size_t, void*>::iterator it) {
    void* ptr = take(pool.free_, it, false);
    reused_.insert(ptr);
    return ptr;
  };
  if (auto it = pool.free_.find(size); it != pool.free_.end()) return reuse(it);
  if (auto it = free_.find(size); it != free_.end()) return take(free_, it, true);
  if (in_use_ + cached_ + size <= budget_) {
    if (void* ptr = driver_->malloc(size)) {  // out of device memory: a larger free block below, as at the budget
      got = size;
      in_use_ += size;
      pool.bytes_ += size;
      ++pool.n_blocks_;
      return ptr;
    }
  }
  if (auto it = pool.free_.lower_bound(size); it != pool.free_.end()) return reuse(it);
  if (auto it = free_.lower_bound(size); it != free_.end()) return take(free_, it, true);
  fail("CUDA memory budget or device memory exhausted during CUDA graph capture: {} bytes requested with {} in use "
       "and {} cached of a {} byte budget, and no free block is large enough (cached blocks cannot be returned to the "
       "driver while a graph is captured)", size, in_use_, cached_, budget_);
}

std::shared_ptr<void> CachingAllocator::allocate(size_t bytes) { return allocate_impl(bytes, false); }

std::shared_ptr<void> CachingAllocator::allocate_persistent(size_t bytes) { return allocate_impl(bytes, true); }

std::shared_ptr<void> CachingAllocator::allocate_impl(size_t bytes, bool persistent) {
  const size_t size = round_size(std::max<size_t>(bytes, 1));
  size_t got = 0;
  void* ptr = nullptr;
  std::shared_ptr<CapturePool> pool;
  {
    std::lock_guard lock(mutex_);
    if (capture_ && !persistent) {
      ptr = take_capture_locked(size, got);
      pool = capture_;
    } else {
      ptr = take_locked(size, got);
      in_use_ += got;
    }
    peak_held_ = std::max(peak_held_, in_use_ + cached_);
    peak_in_use_ = std::max(peak_in_use_, in_use_);
  }
  std::weak_ptr<CachingAllocator> self = weak_from_this();
  std::weak_ptr<CapturePool> owner = pool;
  return std::shared_ptr<void>(ptr, [self, owner, driver = driver_, got](void* p) {
    if (auto alloc = self.lock()) {
      alloc->give_back(p, got, owner.lock());
    } else {
      driver->free(p);  // the allocator is gone (its backend was destroyed): no capture can be running
    }
  });
}

void CachingAllocator::give_back(void* ptr, size_t size, const std::shared_ptr<CapturePool>& pool) {
  std::lock_guard lock(mutex_);
  if (pool) {
    pool->free_.emplace(size, ptr);  // still the graph's: reusable only inside its own capture (or arena)
    if (pool == capture_) reused_.erase(ptr);
    return;
  }
  in_use_ -= size;
  cached_ += size;
  free_.emplace(size, ptr);
}

void CachingAllocator::return_pool(CapturePool& pool) {
  std::lock_guard lock(mutex_);
  for (auto& [size, p] : pool.free_) {
    in_use_ -= size;
    cached_ += size;
    free_.emplace(size, p);
  }
  pool.free_.clear();
}

size_t CachingAllocator::bytes_in_use() const {
  std::lock_guard lock(mutex_);
  return in_use_;
}

size_t CachingAllocator::bytes_cached() const {
  std::lock_guard lock(mutex_);
  return cached_;
}

size_t CachingAllocator::peak_bytes_held() const {
  std::lock_guard lock(mutex_);
  return peak_held_;
}

size_t CachingAllocator::peak_bytes_in_use() const {
  std::lock_guard lock(mutex_);
  return peak_in_use_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  peak_held_ = in_use_ + cached_;
  peak_in_use_ = in_use_;
}

void CachingAllocator::release_cache() {
  std::lock_guard lock(mutex_);
  release_locked();
}

void CachingAllocator::release_locked() {
  if (capture_) {
    release_deferred_ = true;
    return;
  }
  for (auto& [size, p] : free_) driver_->free(p);
  free_.clear();
  cached_ = 0;
  release_deferred_ = false;
}

std::shared_ptr<CapturePool> CachingAllocator::begin_capture(std::shared_ptr<CapturePool> arena) {
  std::lock_guard lock(mutex_);
  BG_CHECK(!capture_, "caching allocator: a capture is already in progress");
  if (arena) {
    BG_CHECK(arena->alloc_.lock().get() == this, "caching allocator: a capture arena of another allocator");
    capture_ = std::move(arena);
  } else {
    capture_.reset(new CapturePool(weak_from_this(), driver_));
  }
  reused_.clear();
  return capture_;
}

std::vector<void*> CachingAllocator::end_capture() {
  std::shared_ptr<CapturePool> ended;  // dropped after the lock: a failed capture's pool returns its blocks then
  std::lock_guard lock(mutex_);
  ended = std::move(capture_);
  std::vector<void*> outlived(reused_.begin(), reused_.end());
  reused_.clear();
  if (release_deferred_) release_locked();
  return outlived;
}

bool CachingAllocator::capturing() const {
  std::lock_guard lock(mutex_);
  return capture_ != nullptr;
}

}  // namespace bg
