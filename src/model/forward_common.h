// Steps every forward file shares: KV block budget from the load options, validating a call and laying out its
// positions, and handing a backend tensor to a tap.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "kv/sequence.h"
#include "model/model.h"

namespace bg {

// MLA cache blocks for the options: max_total_tokens, or max_sequences full contexts.
int64_t kv_blocks_for(int64_t max_position_embeddings, const LoadOptions& options);

// Checks the ids and the context limit, reserves the sequence's KV blocks and returns the tokens' positions
// (seq.n_past() + t). Throws bg::Error before touching any state.
std::vector<int64_t> begin_forward(Sequence& seq, std::span<const int32_t> tokens, const ModelInfo& info);

// Runs the model's route hook (if any) on one MoE layer's routing and writes back what it changed.
void apply_route_hook(Backend& backend, const RouteHook& hook, int64_t layer, Tensor& ids, Tensor& weights);

// Downloads `t` [n, dim] and passes it to the tap (no-op without one).
void tap_tensor(Backend& backend, const TapFn* tap, std::string_view name, int64_t layer, const Tensor& t);

}  // namespace bg
