// Scheduling policies: budget, admission, length limits.
#include "sched/policies.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace bg::sched {

int64_t blocks_for_tokens(int64_t n_tokens, int64_t block_tokens) {
  return (n_tokens + block_tokens - 1) / block_tokens;
}

PoolState PoolState::of(const kv::StateUsage& u) {
  return {std::max<int64_t>(u.kv_block_tokens, 1), u.kv_blocks_free + u.kv_blocks_cached, u.kv_blocks_total,
          u.state_slots_free + u.state_slots_cached, u.state_slots_total};
}

int64_t TokenBudget::take(int64_t want) {
  const int64_t n = std::clamp<int64_t>(want, 0, left_);
  left_ -= n;
  return n;
}

int64_t AdmissionPolicy::headroom_blocks(const PoolState& pools, int64_t n_running) const {
  if (n_running == 0) return 0;
  const auto watermark = static_cast<int64_t>(std::ceil(watermark_ * static_cast<double>(pools.total_blocks)));
  return std::max<int64_t>(watermark, 1);
}

bool AdmissionPolicy::admit(const PoolState& pools, int64_t n_running, int64_t n_tokens) const {
  return admit_blocks(pools, n_running, blocks_for_tokens(n_tokens, pools.block_tokens));
}

bool AdmissionPolicy::admit_blocks(const PoolState& pools, int64_t n_running, int64_t need_blocks) const {
  if (n_running >= max_num_seqs_) return false;
  if (pools.total_slots > 0 && pools.free_slots == 0) return false;
  return pools.free_blocks >= need_blocks + headroom_blocks(pools, n_running);
}

LengthDecision check_length(int64_t n_prompt, int64_t max_tokens, int64_t max_model_len) {
  LengthDecision d;
  if (n_prompt >= max_model_len) {
    d.error = fmt::format("this model's maximum context length is {} tokens, but the prompt has {} tokens (no room "
                          "for a completion)", max_model_len, n_prompt);
    return d;
  }
  d.max_new_tokens = std::min(max_tokens, max_model_len - n_prompt);
  return d;
}

}  // namespace bg::sched
