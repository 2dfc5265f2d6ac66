// The step memory profile a worker runs after loading the weights and before sizing the KV cache: what the largest
// prefill step needs of the device beyond the weights and the pools (the planner keeps it out of the KV budget;
// docs/SERVING_ENGINE.md, "Step reserve").
#pragma once

#include <cstdint>

#include "dist/rank_context.h"
#include "model/model.h"

namespace bg::engine {

// A throwaway sequence prefills pseudo-random ids in steps of `step_tokens` until its context holds `pass_rows` (the
// largest MLA prefill pass) and one more step, or `max_len`; the result is the allocator's peak in use during those
// steps less what it had in use before them (the throwaway pools), plus 5 % for what another prompt may route
// differently. The cached blocks stay for the steps that follow. Backends that do not count their memory give 0.
//
// One rank of a set (`ranks` non-null) is a collective: every rank calls it with the same arguments; the DP groups'
// leaders prefill their own throwaway sequences, TP followers run their leader's layouts on pools of their own
// (Model::sync_idle), and every rank returns the largest need over the set.
int64_t profile_step_memory(Model& model, const dist::RankContext* ranks, int64_t step_tokens, int64_t max_len,
                            int64_t pass_rows);

}  // namespace bg::engine
