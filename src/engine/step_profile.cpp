// profile_step_memory.
#include "engine/step_profile.h"

#include <algorithm>
#include <array>
#include <memory>
#include <span>
#include <vector>

#include "core/error.h"
#include "dist/comm.h"
#include "kv/state_manager.h"

namespace bg::engine {

int64_t profile_step_memory(Model& model, const dist::RankContext* ranks, int64_t step_tokens, int64_t max_len,
                            int64_t pass_rows) {
  BG_CHECK(step_tokens >= 1 && max_len >= 1 && pass_rows >= 0, "step profile: {} tokens per step, max_len {}",
           step_tokens, max_len);
  BG_CHECK((ranks != nullptr) == model.collective(), "step profile: the rank context does not match the model");
  const int64_t n = std::min(max_len, pass_rows + step_tokens);
  const int64_t vocab = model.info().vocab_size;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 13) % vocab);
  // A TP follower's pools mirror its leader's: the same state, and a sequence placed as the leader's is.
  std::unique_ptr<kv::StateManager> state = make_state(model, 1, n);
  std::unique_ptr<Sequence> seq = state->new_sequence(n);
  const bool runs_steps = ranks == nullptr || ranks->place.is_leader();
  Backend& be = model.backend();
  be.reset_memory_peak();
  const size_t before = be.memory_use().in_use;
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (int64_t start = 0; start < n; start += step_tokens) {
    if (!runs_steps) {
      BG_CHECK(model.sync_idle(false, state->step_pools()), "step profile: the rank set stopped");
      continue;
    }
    const int64_t len = std::min(step_tokens, n - start);
    const BatchEntry entry{seq.get(), std::span<const int32_t>(ids).subspan(static_cast<size_t>(start),
                                                                            static_cast<size_t>(len))};
    model.forward_batch(std::span<const BatchEntry>(&entry, 1), logits.data());
  }
  const size_t peak = be.memory_use().peak_in_use;
  std::array<int64_t, 1> need{static_cast<int64_t>(static_cast<double>(peak > before ? peak - before : 0) * 1.05)};
  if (ranks != nullptr) ranks->world->all_reduce_max(need);
  return need[0];
}

}  // namespace bg::engine
