// One sequence's state as the model sees it: its position, its MLA KV blocks and (Kimi-K3) its KDA state slot, all
// owned by the kv::StateManager that made it. Lifetime rule: a Sequence is created by StateManager::new_sequence /
// start_sequence and must be destroyed before that manager (its destructor hands the blocks, slot and host pages back
// to it); the engine declares the manager before the scheduler that holds the requests' sequences.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/kda_state_pool.h"
#include "kv/mla_kv_pool.h"

namespace bg {

namespace kv {
class StateManager;
}

// Where a sequence's state lives: on the GPU (runnable), in the host tier (offloaded: not runnable until restored).
enum class Residency : uint8_t { kGpu, kHost };

// The pools a step reads: every sequence of a step belongs to the same manager. state is null without KDA layers.
struct StepPools {
  const MlaKvPool* kv = nullptr;
  const KdaStatePool* state = nullptr;
};

class Sequence {
 public:
  ~Sequence();
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  // Tokens already processed (the next token's position).
  int64_t n_past() const { return n_past_; }
  // Called by the model after a step ran this sequence's tokens.
  void advance(int64_t n_tokens) { n_past_ += n_tokens; }
  // GPU blocks covering positions [0, kv_blocks().size() * block size); reserved through StateManager::reserve.
  const std::vector<int32_t>& kv_blocks() const { return kv_blocks_; }
  // KDA state slot index (-1 without KDA layers).
  int32_t kda_slot() const { return kda_slot_; }
  Residency residency() const { return residency_; }
  // Tokens this sequence took from the prefix cache when it started (it began at n_past() == n_cached()).
  int64_t n_cached() const { return n_cached_; }
  kv::StateManager& manager() const { return *manager_; }
  StepPools pools() const;

 private:
  friend class kv::StateManager;
  explicit Sequence(kv::StateManager* manager) : manager_(manager) {}

  kv::StateManager* manager_;
  int64_t n_past_ = 0;
  int64_t n_cached_ = 0;
  std::vector<int32_t> kv_blocks_;
  int32_t kda_slot_ = -1;
  Residency residency_ = Residency::kGpu;
  // While offloaded: one host page per KV block, the state slot's pages.
  std::vector<int32_t> host_block_pages_;
  std::vector<int32_t> host_slot_pages_;
  // Tokens of this sequence already inserted into the prefix cache (StateManager::commit).
  int64_t cache_committed_ = 0;
};

}  // namespace bg
