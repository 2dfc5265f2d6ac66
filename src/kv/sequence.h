// One sequence's state: its position, its MLA KV blocks and (Kimi-K3) its KDA state slot. Releases what it holds
// when destroyed, so a cancelled or finished request frees its memory at once.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/kda_state_pool.h"
#include "kv/mla_kv_pool.h"

namespace bg {

class Sequence {
 public:
  // Either pool may be null (an architecture without MLA or without KDA layers).
  Sequence(MlaKvPool* kv_pool, KdaStatePool* kda_pool);
  ~Sequence();
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  // Tokens already processed (the next token's position).
  int64_t n_past() const { return n_past_; }
  void advance(int64_t n_tokens) { n_past_ += n_tokens; }
  // Makes sure the KV blocks cover positions [0, n_tokens); allocates from the pool (throws when full).
  void reserve_kv(int64_t n_tokens);
  const std::vector<int32_t>& kv_blocks() const { return kv_blocks_; }
  // KDA state slot index (-1 without KDA layers).
  int32_t kda_slot() const { return kda_slot_; }

 private:
  MlaKvPool* kv_pool_;
  KdaStatePool* kda_pool_;
  int64_t n_past_ = 0;
  std::vector<int32_t> kv_blocks_;
  int32_t kda_slot_ = -1;
};

}  // namespace bg
