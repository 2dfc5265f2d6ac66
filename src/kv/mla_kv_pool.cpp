// MlaKvPool: a reference-counted free list over one backend allocation.
#include "kv/mla_kv_pool.h"

#include "core/error.h"

namespace bg {

MlaKvPool::MlaKvPool(Backend& backend, const StateGeometry& g, int64_t block_size, int64_t n_blocks)
    : backend_(backend),
      n_layers_(g.n_mla_layers),
      kv_lora_rank_(g.kv_lora_rank),
      entry_dim_(g.entry_dim()),
      block_size_(block_size),
      n_blocks_(n_blocks),
      act_bytes_(dtype_size_bytes(backend.act_dtype())) {
  BG_CHECK(n_layers_ >= 0 && entry_dim_ > 0 && block_size > 0 && n_blocks >= 0,
           "MlaKvPool: bad geometry (layers {}, entry {}, block {}, blocks {})", n_layers_, entry_dim_, block_size,
           n_blocks);
  if (n_layers_ > 0 && n_blocks > 0) {
    storage_ = backend.zeros({n_blocks + 1, n_layers_, block_size, entry_dim_}, backend.act_dtype());
  }
  refs_.assign(static_cast<size_t>(n_blocks), 0);
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back({static_cast<int32_t>(b), 0});
}

void MlaKvPool::check_block(int32_t block, const char* what) const {
  BG_CHECK(block >= 0 && block < n_blocks_ && refs_[static_cast<size_t>(block)] > 0, "MlaKvPool: {} block {} that is "
           "not in use", what, block);
}

int32_t MlaKvPool::alloc_block() {
  BG_CHECK(!free_.empty(), "MLA KV cache is full: all {} blocks of {} tokens are in use", n_blocks_, block_size_);
  const FreeBlock f = free_.back();
  free_.pop_back();
  if (f.reading != 0) backend_.compute_wait(f.reading);
  refs_[static_cast<size_t>(f.block)] = 1;
  return f.block;
}

void MlaKvPool::ref(int32_t block) {
  check_block(block, "referencing");
  ++refs_[static_cast<size_t>(block)];
}

void MlaKvPool::unref(int32_t block, CopyFence reading) {
  check_block(block, "freeing");
  if (--refs_[static_cast<size_t>(block)] == 0) free_.push_back({block, reading});
}

int32_t MlaKvPool::refcount(int32_t block) const {
  BG_CHECK(block >= 0 && block < n_blocks_, "MlaKvPool: block {} outside [0, {})", block, n_blocks_);
  return refs_[static_cast<size_t>(block)];
}

void MlaKvPool::copy_block(int32_t src, int32_t dst) {
  check_block(src, "copying");
  check_block(dst, "copying into");
  Tensor to = storage_.rows_view(dst, 1);
  backend_.copy(storage_.rows_view(src, 1), to);
}

MlaCacheRef MlaKvPool::layer_ref(int64_t mla_layer) const {
  return MlaCacheRef{storage_, n_layers_, block_size_, entry_dim_, kv_lora_rank_, mla_layer};
}

}  // namespace bg
