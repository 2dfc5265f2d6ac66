// Paged MLA latent cache: fixed-size blocks of `block_size` tokens, each token holding `entry_dim` fp32 values
// (c_kv | k_pe, 576 for DeepSeek-V3 / Kimi) for every MLA layer. One pool per model instance; sequences own blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace bg {

class MlaKvPool {
 public:
  // n_layers: MLA layers only (the pool indexes them densely 0..n_layers-1).
  MlaKvPool(int64_t n_layers, int64_t entry_dim, int64_t block_size, int64_t n_blocks);

  int64_t block_size() const { return block_size_; }
  int64_t entry_dim() const { return entry_dim_; }
  int64_t n_blocks() const { return n_blocks_; }
  int64_t n_free_blocks() const { return static_cast<int64_t>(free_.size()); }
  // Bytes the pool may grow to (blocks are allocated on first use, up to n_blocks).
  int64_t capacity_bytes() const { return n_blocks_ * bytes_per_block(); }
  int64_t bytes_per_block() const { return n_layers_ * block_size_ * entry_dim_ * 4; }

  // Throws bg::Error when the pool is exhausted.
  int32_t alloc_block();
  void free_block(int32_t block);
  // [block_size, entry_dim] for one MLA layer of one block.
  float* block_data(int32_t block, int64_t mla_layer);
  const float* block_data(int32_t block, int64_t mla_layer) const;

 private:
  int64_t n_layers_, entry_dim_, block_size_, n_blocks_;
  std::vector<std::vector<float>> blocks_;  // each [n_layers, block_size, entry_dim], allocated on first use
  std::vector<int32_t> free_;
  std::vector<uint8_t> in_use_;
};

}  // namespace bg
