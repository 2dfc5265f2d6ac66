// Scheduling policies as small classes over plain numbers (tested without a model): the step's token budget,
// admission against the pools, the preemption victim, and the length limits of a request.
#pragma once

#include <cstdint>
#include <string>

#include "kv/state_manager.h"

namespace bg::sched {

int64_t blocks_for_tokens(int64_t n_tokens, int64_t block_tokens);

// The GPU pools as admission sees them: what a new sequence can get counts free units and prefix-cache entries the
// state manager would evict for it.
struct PoolState {
  int64_t block_tokens = 1;
  int64_t free_blocks = 0;
  int64_t total_blocks = 0;
  int64_t free_slots = 0;
  int64_t total_slots = 0;  // 0: the model has no state slots (no KDA layers)

  static PoolState of(const kv::StateUsage& u);
};

// Tokens one step may run (--chunked-prefill-size): decodes take one each first, prefill chunks take the rest, so a
// long prompt spans several steps.
class TokenBudget {
 public:
  explicit TokenBudget(int64_t n_tokens) : left_(n_tokens) {}
  int64_t left() const { return left_; }
  // Takes up to `want` tokens; returns how many were granted (0 once the budget is spent).
  int64_t take(int64_t want);

 private:
  int64_t left_;
};

// A waiting request starts only when fewer than max_num_seqs run, a state slot is free, and the free KV blocks cover
// all its tokens plus a watermark (a fraction of the pool, at least one block) kept for the running sequences to
// grow into. With nothing running the watermark is waived, so any request of max_model_len can start.
class AdmissionPolicy {
 public:
  AdmissionPolicy(int64_t max_num_seqs, double watermark) : max_num_seqs_(max_num_seqs), watermark_(watermark) {}
  int64_t headroom_blocks(const PoolState& pools, int64_t n_running) const;
  bool admit(const PoolState& pools, int64_t n_running, int64_t n_tokens) const;
  // The same with the blocks counted by the caller (a prefix-cache hit shares some; a restore brings its own back).
  bool admit_blocks(const PoolState& pools, int64_t n_running, int64_t need_blocks) const;

 private:
  int64_t max_num_seqs_;
  double watermark_;
};

// Preemption: when a decode step cannot get a KV block, the most recently admitted running request gives its blocks
// and slot back and returns to the head of the waiting queue (its state offloaded to the host tier when there is
// room, else recomputed when it runs again). `running` is in admission order.
class PreemptionPolicy {
 public:
  size_t victim(size_t n_running) const { return n_running - 1; }
};

// Length limits: a prompt must leave room for one token within max_model_len (else error 400); max_tokens is capped
// so that prompt + completion <= max_model_len.
struct LengthDecision {
  std::string error;            // non-empty: reject with 400
  int64_t max_new_tokens = 0;
};
LengthDecision check_length(int64_t n_prompt, int64_t max_tokens, int64_t max_model_len);

}  // namespace bg::sched
