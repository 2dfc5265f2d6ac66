// Steps every forward file shares: validating a call and laying out its positions over the sequences' pools, and
// handing a backend tensor to a tap.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "kv/sequence.h"
#include "model/model.h"

namespace bg {

// The pools of a batch's sequences: all on the GPU tier of one kv::StateManager (else bg::Error).
StepPools step_pools_of(std::span<const BatchEntry> batch);

// Checks every entry (a sequence, tokens, ids in range, the context limit, no sequence twice, KV reserved for the
// tokens) and lays the step out (block tables max_blocks wide, step_table_width, the rest filled with the pools'
// padding block). Throws bg::Error before any sequence changes. An empty batch gives
// an empty layout (a rank without work pads it: pad_decode_step).
StepLayout layout_step(std::span<const BatchEntry> batch, const ModelInfo& info, const StepPools& pools);

// The width of a step's block tables: the widest sequence's blocks rounded up to a power of two, and at least the
// blocks of kMinTableTokens (or of max_positions, when fewer), as a power of two. The width is part of a decode graph's
// key, so the floor keeps every context up to 16k tokens on one graph per batch bucket (captured at warm-up) instead
// of one per power-of-two width met while serving; its cost is the wider table's upload (64 KiB at 64 sequences with
// 64-token blocks).
inline constexpr int64_t kMinTableTokens = 16384;
int64_t step_table_width(int64_t widest, int64_t block_size, int64_t max_positions);

// Appends single-token padding sequences (token 0 at position 0, the pools' padding block and slot) up to n_seqs.
void pad_decode_step(StepLayout& step, int64_t n_seqs, const StepPools& pools);

// The CUDA-graph batch size for a decode step of n sequences, or 0 when n exceeds max_batch: n rounded up to the next
// bucket — every power of two up to 16, then multiples of 8 up to 64, of 32 up to 256 and of 64 beyond (a step of 33
// sequences runs 40 rows, not 64). BG_GRAPH_BUCKETS=pow2 (read once) rounds to the next power of two instead, the
// buckets before 2026-12-05, for comparisons.
int64_t graph_bucket(int64_t n_seqs, int64_t max_batch);
// The same with the policy given: fine (the default) or powers of two only.
int64_t graph_bucket(int64_t n_seqs, int64_t max_batch, bool powers_of_two);
// Whether BG_GRAPH_BUCKETS asks for powers of two ("pow2"; unset, empty or "fine": the finer buckets; anything else
// throws bg::Error naming the variable).
bool graph_buckets_pow2(const char* env_value);

// Advances every entry's sequence by its token count (after a step ran).
void finish_step(std::span<const BatchEntry> batch);

// Runs the model's route hook (if any) on one MoE layer's routing and writes back what it changed.
void apply_route_hook(Backend& backend, const RouteHook& hook, int64_t layer, Tensor& ids, Tensor& weights);

// The projections of x by a linear group's parts ([n, n_out_i], act dtype): all at once from one fused product where
// the backend fuses the group at x's row count (decode), else each part's when asked for, so a prefill holds only the
// parts its caller keeps. Ask for each part once: unfused, every call computes it again.
class GroupProjections {
 public:
  GroupProjections(Backend& be, LinearGroup g, Tensor x);
  Tensor operator[](size_t i) const;
  size_t size() const { return g_.parts.size(); }

 private:
  Backend& be_;
  LinearGroup g_;
  Tensor x_;
  std::vector<Tensor> fused_;
};

// Downloads `t` [n, dim] and passes it to the tap (no-op without one).
void tap_tensor(Backend& backend, const TapFn* tap, std::string_view name, int64_t layer, const Tensor& t);

}  // namespace bg
