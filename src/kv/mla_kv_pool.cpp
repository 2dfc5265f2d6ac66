// MlaKvPool: a free list over one backend allocation.
#include "kv/mla_kv_pool.h"

#include "core/error.h"

namespace bg {

MlaKvPool::MlaKvPool(Backend& backend, int64_t n_layers, int64_t kv_lora_rank, int64_t rope_dim, int64_t block_size,
                     int64_t n_blocks)
    : n_layers_(n_layers),
      kv_lora_rank_(kv_lora_rank),
      entry_dim_(kv_lora_rank + rope_dim),
      block_size_(block_size),
      n_blocks_(n_blocks) {
  const int64_t entry_dim = entry_dim_;
  BG_CHECK(n_layers >= 0 && entry_dim > 0 && block_size > 0 && n_blocks >= 0,
           "MlaKvPool: bad geometry (layers {}, entry {}, block {}, blocks {})", n_layers, entry_dim, block_size,
           n_blocks);
  if (n_layers > 0 && n_blocks > 0) {
    storage_ = backend.zeros({n_blocks + 1, n_layers, block_size, entry_dim}, backend.act_dtype());
  }
  in_use_.assign(static_cast<size_t>(n_blocks), 0);
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

int32_t MlaKvPool::alloc_block() {
  BG_CHECK(!free_.empty(), "MLA KV cache is full: all {} blocks of {} tokens are in use", n_blocks_, block_size_);
  int32_t b = free_.back();
  free_.pop_back();
  in_use_[static_cast<size_t>(b)] = 1;
  return b;
}

void MlaKvPool::free_block(int32_t block) {
  BG_CHECK(block >= 0 && block < n_blocks_ && in_use_[static_cast<size_t>(block)], "MlaKvPool: freeing block {} "
           "that is not in use", block);
  in_use_[static_cast<size_t>(block)] = 0;
  free_.push_back(block);
}

MlaCacheRef MlaKvPool::layer_ref(int64_t mla_layer) const {
  return MlaCacheRef{storage_, n_layers_, block_size_, entry_dim_, kv_lora_rank_, mla_layer};
}

}  // namespace bg
