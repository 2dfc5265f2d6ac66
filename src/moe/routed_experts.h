// The MoE layer's routed part as route -> dispatch -> experts -> combine. Dispatch/combine go through an exchange so
// expert parallelism can replace the single-rank loopback without touching the model code.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace bg {

// Tokens grouped by expert after routing: for expert e, rows [offsets[e], offsets[e+1]) of `token_idx`/`slot_weight`.
struct ExpertDispatch {
  int64_t n_experts = 0;
  std::vector<int64_t> offsets;      // [n_experts + 1]
  std::vector<int64_t> token_idx;    // source token of each dispatched row
  std::vector<float> slot_weight;    // routing weight of each dispatched row
};

// Builds the per-expert grouping from top-k routing (ids [n_tokens, top_k], weights [n_tokens, top_k]).
ExpertDispatch group_by_expert(const int32_t* expert_ids, const float* weights, int64_t n_tokens, int64_t top_k,
                               int64_t n_experts);

// An expert's computation on `n_rows` gathered inputs: in [n_rows, in_dim] -> out [n_rows, out_dim].
using ExpertFn = std::function<void(int64_t expert, const float* in, int64_t n_rows, float* out)>;

// Single-rank exchange: gathers each expert's rows from x [n_tokens, in_dim], runs `expert_fn`, and accumulates
// sum_k w_k * y_k into out [n_tokens, out_dim] (added to what `out` holds) in fp32.
void run_routed_experts_loopback(const ExpertDispatch& dispatch, const float* x, int64_t n_tokens, int64_t in_dim,
                                 int64_t out_dim, const ExpertFn& expert_fn, float* out);

}  // namespace bg
