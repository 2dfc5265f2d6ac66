// CachingAllocator: size-rounded free lists under one mutex.
#include "backend/cuda/cuda_allocator.h"

#include <algorithm>

#include "backend/cuda/cuda_check.h"

namespace bg::cuda {

CachingAllocator::CachingAllocator(size_t budget_bytes) : budget_(budget_bytes) {
  if (budget_ == 0) {
    size_t free_bytes = 0, total = 0;
    BG_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    budget_ = free_bytes;
  }
}

CachingAllocator::~CachingAllocator() { release_cache(); }

size_t CachingAllocator::round_size(size_t bytes) {
  constexpr size_t kSmall = 512, kLarge = size_t{2} << 20;
  if (bytes <= kLarge) {
    size_t s = kSmall;
    while (s < bytes) s *= 2;  // powers of two up to 2 MiB
    return s;
  }
  return (bytes + kLarge - 1) / kLarge * kLarge;  // then 2 MiB granules
}

std::shared_ptr<void> CachingAllocator::allocate(size_t bytes) {
  const size_t size = round_size(std::max<size_t>(bytes, 1));
  void* ptr = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first == size) {
      ptr = it->second;
      free_.erase(it);
      cached_ -= size;
    } else {
      if (in_use_ + cached_ + size > budget_) {
        for (auto& [s, p] : free_) cudaFree(p);
        free_.clear();
        cached_ = 0;
      }
      BG_CHECK(in_use_ + size <= budget_, "CUDA memory budget exceeded: {} bytes requested with {} in use of a {} "
               "byte budget", bytes, in_use_, budget_);
      BG_CUDA_CHECK(cudaMalloc(&ptr, size));
    }
    in_use_ += size;
  }
  std::weak_ptr<CachingAllocator> self = weak_from_this();
  std::shared_ptr<void> block(ptr, [self, size](void* p) {
    if (auto alloc = self.lock()) {
      alloc->give_back(p, size);
    } else {
      cudaFree(p);
    }
  });
  std::lock_guard lock(mutex_);
  if (sink_ != nullptr) sink_->push_back(block);
  return block;
}

void CachingAllocator::set_capture_sink(std::vector<std::shared_ptr<void>>* sink) {
  std::lock_guard lock(mutex_);
  sink_ = sink;
}

void CachingAllocator::give_back(void* ptr, size_t size) {
  std::lock_guard lock(mutex_);
  in_use_ -= size;
  cached_ += size;
  free_.emplace(size, ptr);
}

size_t CachingAllocator::bytes_in_use() const {
  std::lock_guard lock(mutex_);
  return in_use_;
}

size_t CachingAllocator::bytes_cached() const {
  std::lock_guard lock(mutex_);
  return cached_;
}

void CachingAllocator::release_cache() {
  std::lock_guard lock(mutex_);
  for (auto& [s, p] : free_) cudaFree(p);
  free_.clear();
  cached_ = 0;
}

}  // namespace bg::cuda
