// The MoE layer as the model calls it: route (router linear in fp32, sigmoid / grouped top-k) -> exchange dispatch
// -> the experts of this rank's slots -> exchange combine. Both architectures use it: DeepSeek-V3 on the hidden state,
// Kimi-K3 in the latent (its router reads the hidden state, its experts the down-projected latent).
#pragma once

#include <functional>

#include "backend/backend.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"

namespace bg::moe {

// One MoE layer's routed part.
struct MoeLayerWeights {
  const LinearHandle* router = nullptr;  // [n_experts, hidden]
  Tensor router_bias;                    // F32 [n_experts] (selection only), may be empty
  ExpertTable experts;
};

struct MoeLayerSpec {
  ops::RouterParams router;  // n_tokens is filled per call
  GluSpec glu;
};

// The router's choices for a step: ids I32 [n, k], weights F32 [n, k] (backend memory).
struct MoeChoice {
  Tensor ids, weights;
  int64_t step_row0 = -1;  // x's first row in the current step (padding rows are dropped at dispatch), -1: unknown
};

// Router logits in fp32 from x [n, hidden], then top-k. step_row0: x's first row in the current step (x is the
// step's rows [step_row0, step_row0 + n)), or -1 when x is not a run of the step's rows.
MoeChoice moe_route(Backend& be, const MoeLayerSpec& spec, const MoeLayerWeights& w, const Tensor& x,
                    int64_t step_row0);

// out[t] += sum_k w(t,k) Expert_{ids(t,k)}(x_expert[t]) through the exchange; `overlap` (may be empty) runs while the
// dispatched rows are in flight (the shared experts). With `accumulate` false out[t] = the sum: `out` needs no zeroing
// first (one rank: the combine overwrites every row, no fill launch; with an exchange `out` is zeroed here).
// Streamed experts (w.experts.streams()) are staged after the dispatch: the step waits for the routing on the host,
// so such layers are never captured in a graph.
void moe_routed(Backend& be, Exchange& exchange, const MoeLayerSpec& spec, MoeLayerWeights& w,
                const MoeChoice& choice, const Tensor& x_expert, Tensor& out, const std::function<void()>& overlap,
                bool accumulate = true);

}  // namespace bg::moe
