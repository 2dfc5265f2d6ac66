// One request's state inside a worker: its tokens (prompt then generated), sampling parameters and generator, how
// much of it the model has seen, and its sequence (KV blocks + state slot, on the GPU or offloaded to the host tier).
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kv/sequence.h"
#include "server/protocol.h"

namespace bg::sched {

struct Request {
  std::string id;
  // The prompt followed by every generated token: one contiguous buffer, so a chunk is a span of it. After a
  // recompute preemption all of it is recomputed (the generated tokens become part of the new "prompt").
  std::vector<int32_t> tokens;
  int64_t n_prompt = 0;
  proto::SamplingParams params;
  int64_t max_new_tokens = 0;     // params.max_tokens capped by max_model_len - n_prompt
  std::mt19937_64 rng;            // seeded per request; one draw per sampled (non-greedy) token
  uint64_t arrival = 0;           // order of arrival at the worker
  // Set while running (and while offloaded to the host tier after a preemption): the model holds tokens
  // [0, n_computed) in `seq`.
  std::unique_ptr<Sequence> seq;
  int64_t n_computed = 0;
  // Tokens the sequence had to compute when it started (its prefill input); only those go into the prefix cache.
  int64_t n_input = 0;
  int64_t n_cached = -1;          // prompt tokens reused from the prefix cache when it first started (-1: not yet)
  int64_t n_preemptions = 0;
  int64_t steps_resident = 0;     // steps run since it last started or came back from the host tier

  int64_t n_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t n_generated() const { return n_tokens() - n_prompt; }
  // Tokens the model still has to run before the next token can be sampled (1 = a decode step).
  int64_t n_pending() const { return n_tokens() - n_computed; }
  bool offloaded() const { return seq != nullptr && seq->residency() == Residency::kHost; }
  std::span<const int32_t> span(int64_t start, int64_t n) const {
    return std::span<const int32_t>(tokens).subspan(static_cast<size_t>(start), static_cast<size_t>(n));
  }
};

}  // namespace bg::sched
