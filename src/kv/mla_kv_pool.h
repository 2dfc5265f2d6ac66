// Paged MLA latent cache: fixed-size blocks of `block_size` tokens, each token holding `entry_dim` values
// (c_kv | k_pe, 576 for DeepSeek-V3 / Kimi) for every MLA layer, in the backend's memory (fp32 on the CPU, bf16 on
// CUDA). One pool per model instance; sequences own blocks through their block tables.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace bg {

class MlaKvPool {
 public:
  // n_layers: MLA layers only (indexed densely 0..n_layers-1). Allocates n_blocks blocks up front.
  MlaKvPool(Backend& backend, int64_t n_layers, int64_t kv_lora_rank, int64_t rope_dim, int64_t block_size,
            int64_t n_blocks);

  int64_t block_size() const { return block_size_; }
  int64_t entry_dim() const { return entry_dim_; }
  int64_t n_blocks() const { return n_blocks_; }
  int64_t n_free_blocks() const { return static_cast<int64_t>(free_.size()); }
  int64_t bytes() const { return static_cast<int64_t>(storage_.nbytes()); }

  // A block that no sequence owns, for the padding entries of a bucketed decode batch and unused block-table entries.
  int32_t pad_block() const { return static_cast<int32_t>(n_blocks_); }
  // Throws bg::Error when the pool is exhausted.
  int32_t alloc_block();
  void free_block(int32_t block);
  // The view attention ops take for one MLA layer.
  MlaCacheRef layer_ref(int64_t mla_layer) const;

 private:
  int64_t n_layers_, kv_lora_rank_, entry_dim_, block_size_, n_blocks_;
  Tensor storage_;  // [n_blocks + 1, n_layers, block_size, entry_dim]: the last block is the padding block
  std::vector<int32_t> free_;
  std::vector<uint8_t> in_use_;
};

}  // namespace bg
