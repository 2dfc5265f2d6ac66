// The host tier: one arena of fixed-size pages in host memory (page-locked on CUDA, through Backend::alloc_host), for
// the KV blocks and KDA state of offloaded sequences and prefix-cache entries. A KV block takes one page; a state slot
// takes as many pages as its (optionally compressed) bytes need, not necessarily adjacent. Pages are handed out and
// returned by the kv::StateManager only; copies into and out of them run on the backend's copy stream in issue
// order, so a page may be reused as soon as it is freed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"

namespace bg::kv {

class HostTier {
 public:
  // n_pages 0: no host tier (every alloc fails).
  HostTier(Backend& backend, int64_t page_bytes, int64_t n_pages);

  int64_t page_bytes() const { return page_bytes_; }
  int64_t n_pages() const { return n_pages_; }
  int64_t n_free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t bytes() const { return page_bytes_ * n_pages_; }
  int64_t bytes_used() const { return (n_pages_ - n_free_pages()) * page_bytes_; }
  int64_t pages_for(int64_t bytes) const { return (bytes + page_bytes_ - 1) / page_bytes_; }
  // `n` pages, or an empty vector (nothing taken) when fewer are free.
  std::vector<int32_t> alloc(int64_t n);
  void free(std::span<const int32_t> pages);
  std::byte* page(int32_t p) const;
  // The copies of device bytes [offset, offset + bytes) of `device` to / from `pages` (page i holds the i-th
  // page_bytes of the range).
  std::vector<HostCopy> copies(const Tensor& device, size_t offset, size_t bytes,
                               std::span<const int32_t> pages) const;
  // Contiguous host bytes <-> pages (compressed state goes through host memory).
  void write(std::span<const std::byte> src, std::span<const int32_t> pages);
  void read(std::span<const int32_t> pages, std::span<std::byte> dst) const;

 private:
  int64_t page_bytes_;
  int64_t n_pages_;
  std::shared_ptr<std::byte> arena_;
  std::vector<int32_t> free_;
  std::vector<uint8_t> in_use_;
};

}  // namespace bg::kv
