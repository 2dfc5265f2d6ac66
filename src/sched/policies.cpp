// Scheduling policies: budget, admission, length limits.
#include "sched/policies.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace bg::sched {

int64_t blocks_for_tokens(int64_t n_tokens, int64_t block_tokens) {
  return (n_tokens + block_tokens - 1) / block_tokens;
}

PoolState PoolState::of(const MemoryUsage& m) {
  return {std::max<int64_t>(m.kv_block_tokens, 1), m.kv_blocks_free, m.kv_blocks_total, m.state_slots_free,
          m.state_slots_total};
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
  if (n_running >= max_num_seqs_) return false;
  if (pools.total_slots > 0 && pools.free_slots == 0) return false;
  const int64_t need = blocks_for_tokens(n_tokens, pools.block_tokens) + headroom_blocks(pools, n_running);
  return pools.free_blocks >= need;
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
