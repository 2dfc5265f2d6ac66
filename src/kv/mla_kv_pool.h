// Paged MLA latent cache: fixed-size blocks of `block_size` tokens, each token holding `entry_dim` values
// (c_kv | k_pe, 576 for DeepSeek-V3 / Kimi) for every MLA layer, in the backend's memory (fp32 on the CPU, bf16 on
// CUDA). Owned by the kv::StateManager; blocks are reference counted (a sequence and the prefix cache may hold the
// same block) and a block freed while a device -> host copy still reads it carries that copy's fence.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "kv/state_geometry.h"

namespace bg {

class MlaKvPool {
 public:
  // Allocates n_blocks blocks (plus the padding block) up front.
  MlaKvPool(Backend& backend, const StateGeometry& geometry, int64_t block_size, int64_t n_blocks);

  int64_t block_size() const { return block_size_; }
  int64_t entry_dim() const { return entry_dim_; }
  int64_t n_blocks() const { return n_blocks_; }
  int64_t n_free_blocks() const { return static_cast<int64_t>(free_.size()); }
  int64_t bytes() const { return static_cast<int64_t>(storage_.nbytes()); }
  // One block over every MLA layer: block b is bytes [b * block_bytes, (b + 1) * block_bytes) of storage().
  int64_t block_bytes() const { return n_layers_ * block_size_ * entry_dim_ * static_cast<int64_t>(act_bytes_); }
  const Tensor& storage() const { return storage_; }

  // A block that no sequence owns, for the padding entries of a bucketed decode batch and unused block-table entries.
  int32_t pad_block() const { return static_cast<int32_t>(n_blocks_); }
  // A block with reference count 1. Throws bg::Error when none is free. Ops issued afterwards wait for a copy that
  // still read the block when it was freed.
  int32_t alloc_block();
  void ref(int32_t block);
  // Drops one reference; the block is free at 0. `reading`: a copy issued before that still reads the block.
  void unref(int32_t block, CopyFence reading = 0);
  int32_t refcount(int32_t block) const;
  // Block `dst` = block `src` over every layer (a device copy in stream order; copy-on-write of a shared block).
  void copy_block(int32_t src, int32_t dst);
  // The view attention ops take for one MLA layer.
  MlaCacheRef layer_ref(int64_t mla_layer) const;

 private:
  struct FreeBlock {
    int32_t block;
    CopyFence reading;
  };
  void check_block(int32_t block, const char* what) const;
  Backend& backend_;
  int64_t n_layers_, kv_lora_rank_, entry_dim_, block_size_, n_blocks_;
  size_t act_bytes_;
  Tensor storage_;  // [n_blocks + 1, n_layers, block_size, entry_dim]: the last block is the padding block
  std::vector<FreeBlock> free_;
  std::vector<int32_t> refs_;
};

}  // namespace bg
