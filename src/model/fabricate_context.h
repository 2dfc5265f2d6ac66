// Fabricated contexts for benchmarks: a sequence made to look as if it had processed n tokens (KV blocks and KDA
// state filled with random values) without running them, so decode steps at 32k context can be timed without hours
// of prefill. The only place that writes pool contents outside a model step.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "kv/kda_state_pool.h"
#include "kv/mla_kv_pool.h"
#include "kv/sequence.h"

namespace bg {

// seq must be empty (n_past 0). Reserves the KV blocks for n_tokens positions and fills them (every MLA layer) with
// Normal(0, 1) latents, fills the sequence's KDA recurrent state with Normal(0, 0.05) and its conv state with
// Normal(0, 1) values, then sets n_past = n_tokens. Values come from a few seeded patterns copied on the device
// (cheap at 256 x 32k tokens); what matters for timing is that every byte a real context would hold is there and
// finite. Either pool may be null (an architecture without MLA or KDA layers). Throws when a pool is too small.
void fabricate_sequence_context(Backend& backend, MlaKvPool* kv_pool, KdaStatePool* kda_pool, Sequence& seq,
                                int64_t n_tokens, uint64_t seed);

}  // namespace bg
