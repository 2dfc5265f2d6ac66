// Fabricated contexts for benchmarks: a sequence made to look as if it had processed n tokens (KV blocks and KDA
// state filled with random values) without running them, so decode steps at 32k context can be timed without hours
// of prefill. The only place that writes pool contents outside a model step.
#pragma once

#include <cstdint>

#include "kv/sequence.h"
#include "kv/state_manager.h"

namespace bg {

// seq must be empty (n_past 0) and belong to `state`. Reserves its KV blocks for n_tokens positions and fills them
// (every MLA layer) with latents of standard deviation 1 (8 seeded block patterns copied on the device: cheap at
// 256 x 32k tokens), fills the sequence's KDA recurrent state (std 0.05) and conv state (std 1) with seeded values,
// then sets n_past = n_tokens. What matters for timing is that every byte a real context would hold is there and
// finite. Throws when the pools are too small.
void fabricate_sequence_context(kv::StateManager& state, Sequence& seq, int64_t n_tokens, uint64_t seed);

}  // namespace bg
