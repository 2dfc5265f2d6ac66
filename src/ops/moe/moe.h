// The routed-expert stages as ops, backend-neutral: dispatch (group the (token, k) pairs whose expert lives on this
// rank by local expert slot, stably), gather (rows into slot order), the expert FFN over each slot's rows, and the
// weighted combine back to token order. The routing arrays share one layout on every backend (one buffer, described
// by MoeRoutingArrays), so the CUDA kernels and this CPU reference read the same thing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "formats/quant.h"

namespace bg::ops {

// Flat (token, k) pairs ranked per dispatch block (the CUDA dispatch's unit of work; the CPU fills the same arrays).
inline constexpr int kMoeDispatchChunk = 256;
// Rows per tile of the tiled expert kernel; dispatch computes per-slot tile offsets for it.
inline constexpr int kMoeTileRows = 64;
inline constexpr int64_t kMoeMaxSlots = 4096;
inline constexpr int64_t kMoeMaxTopK = 32;

// Shape of one layer's routing on one rank. Pairs: n_tokens * top_k (t, k), index t * top_k + k. A pair whose expert
// is held by another rank (slot_map < 0) gets no row here: slot_row = -1.
struct MoeRoutingShape {
  int64_t n_tokens = 0;
  int64_t top_k = 0;
  int64_t n_experts = 0;  // global expert ids are in [0, n_experts)
  int64_t n_slots = 0;    // local expert slots on this rank
  // Every routed expert must have a slot here (one rank, or a rank whose streamed experts must all be resident): a
  // pair without one is an error instead of being left to another rank.
  bool all_local = false;
  int64_t n_pairs() const { return n_tokens * top_k; }
  int64_t n_chunks() const { return (n_pairs() + kMoeDispatchChunk - 1) / kMoeDispatchChunk; }
};

// Views into one routing buffer (moe_routing_layout). Rows are the local pairs in slot order: slot s owns rows
// [offsets[s], offsets[s + 1]), in (token, k) order; offsets[n_slots] = rows on this rank (<= n_pairs).
struct MoeRoutingArrays {
  int32_t* counts = nullptr;        // [n_slots] rows per slot
  int32_t* offsets = nullptr;       // [n_slots + 1]
  int32_t* tile_offsets = nullptr;  // [n_slots + 1] cumulative ceil(counts / kMoeTileRows)
  int32_t* active = nullptr;        // [n_slots] slots with rows, ascending; the first *n_active are valid
  int32_t* n_active = nullptr;      // [1]
  int32_t* chunk_base = nullptr;    // [n_slots, n_chunks] per slot: each chunk's rows before it (dispatch scratch)
  int32_t* pair_rank = nullptr;     // [n_pairs] rank of the pair among its chunk's pairs of the same slot (scratch)
  int32_t* row_token = nullptr;     // [n_pairs] source token of each row
  float* row_weight = nullptr;      // [n_pairs] routing weight of each row
  int32_t* slot_row = nullptr;      // [n_pairs] row of pair (t, k), -1 when its expert is not on this rank
};

// Throws bg::Error naming the bad field.
void moe_check_shape(const MoeRoutingShape& s);
// Bytes of the routing buffer (each array at a 256-byte offset) and its layout over `base` (64-byte aligned).
size_t moe_routing_bytes(const MoeRoutingShape& s);
MoeRoutingArrays moe_routing_layout(const MoeRoutingShape& s, void* base);

// GLU of the experts: SwiGLU silu(g) * u (DeepSeek-V3) or SiTU [beta tanh(g/beta) sigmoid(g)] [beta_lin tanh(u/beta_lin)]
// (Kimi-K3, ops/situ/situ.h).
enum class MoeGlu : uint8_t { kSwiGlu, kSitu };
struct MoeGluParams {
  MoeGlu kind = MoeGlu::kSwiGlu;
  float beta = 4.0f;
  float beta_lin = 25.0f;
};

// One expert's weights on the CPU: gate/up [inter, hidden], down [hidden, inter].
struct MoeExpertCpu {
  const QuantWeight* gate = nullptr;
  const QuantWeight* up = nullptr;
  const QuantWeight* down = nullptr;
};

// ---- CPU reference (fp32) ----------------------------------------------------------------------------------------
// ids / weights [n_pairs]; slot_map [n_experts] (local slot of each global expert, -1 if elsewhere). An id outside
// [0, n_experts) is an error, and so is a pair without a local slot when s.all_local. Fills every array of `r`.
// live_tokens >= 0: tokens from live_tokens on are padding (a graph bucket's filler rows): their pairs are dropped
// like another rank's (slot_row -1, no error, their ids not read).
void moe_dispatch_cpu(const MoeRoutingShape& s, const int32_t* slot_map, const int32_t* ids, const float* weights,
                      const MoeRoutingArrays& r, int64_t live_tokens = -1);
// rows[row] = x[row_token[row]] for the rows on this rank; x [n_tokens, dim], rows [n_pairs, dim].
void moe_gather_cpu(const MoeRoutingShape& s, const MoeRoutingArrays& r, const float* x, int64_t dim, float* rows);
// y_rows = down(glu(gate(rows), up(rows))) per slot; experts [n_slots]; rows [n_pairs, hidden] -> y [n_pairs, hidden].
// round_h rounds the GLU output to bf16 (the CPU backend's bf16 emulation: the CUDA kernels store it as bf16).
void moe_experts_cpu(const MoeRoutingShape& s, const MoeRoutingArrays& r, std::span<const MoeExpertCpu> experts,
                     const MoeGluParams& glu, const float* rows, float* y_rows, bool round_h);
// out[t] += sum_k w(t,k) y_rows[slot_row(t,k)] in k order, fp32, over the pairs on this rank; out [n_tokens, dim].
void moe_combine_cpu(const MoeRoutingShape& s, const MoeRoutingArrays& r, const float* y_rows, int64_t dim,
                     float* out);

}  // namespace bg::ops
