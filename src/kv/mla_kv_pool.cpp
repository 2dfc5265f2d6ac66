// MlaKvPool: a free list over one contiguous allocation.
#include "kv/mla_kv_pool.h"

#include "core/error.h"

namespace bg {

MlaKvPool::MlaKvPool(int64_t n_layers, int64_t entry_dim, int64_t block_size, int64_t n_blocks)
    : n_layers_(n_layers), entry_dim_(entry_dim), block_size_(block_size), n_blocks_(n_blocks) {
  BG_CHECK(n_layers >= 0 && entry_dim > 0 && block_size > 0 && n_blocks >= 0,
           "MlaKvPool: bad geometry (layers {}, entry {}, block {}, blocks {})", n_layers, entry_dim, block_size,
           n_blocks);
  blocks_.resize(static_cast<size_t>(n_blocks));
  in_use_.assign(static_cast<size_t>(n_blocks), 0);
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

int32_t MlaKvPool::alloc_block() {
  BG_CHECK(!free_.empty(), "MLA KV cache is full: all {} blocks of {} tokens are in use", n_blocks_, block_size_);
  int32_t b = free_.back();
  free_.pop_back();
  in_use_[static_cast<size_t>(b)] = 1;
  auto& data = blocks_[static_cast<size_t>(b)];
  if (data.empty()) data.assign(static_cast<size_t>(n_layers_ * block_size_ * entry_dim_), 0.0f);
  return b;
}

void MlaKvPool::free_block(int32_t block) {
  BG_CHECK(block >= 0 && block < n_blocks_ && in_use_[static_cast<size_t>(block)], "MlaKvPool: freeing block {} "
           "that is not in use", block);
  in_use_[static_cast<size_t>(block)] = 0;
  free_.push_back(block);
}

float* MlaKvPool::block_data(int32_t block, int64_t mla_layer) {
  return blocks_[static_cast<size_t>(block)].data() + mla_layer * block_size_ * entry_dim_;
}

const float* MlaKvPool::block_data(int32_t block, int64_t mla_layer) const {
  return blocks_[static_cast<size_t>(block)].data() + mla_layer * block_size_ * entry_dim_;
}

}  // namespace bg
