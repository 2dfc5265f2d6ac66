// The routing buffer's layout (shared by every backend) and the CPU reference of the MoE stages.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/linear/linear.h"
#include "ops/moe/moe.h"
#include "ops/situ/situ.h"
#include "ops/swiglu/swiglu.h"

namespace bg::ops {
namespace {

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Every array in order at `base` (0 when only the size is wanted).
MoeRoutingArrays layout_at(const MoeRoutingShape& s, uintptr_t base, size_t* total) {
  const int64_t S = s.n_slots, pairs = s.n_pairs();
  size_t off = 0;
  auto take = [&](auto*& ptr, int64_t count) {
    using T = std::remove_reference_t<decltype(*ptr)>;
    ptr = reinterpret_cast<T*>(base + off);
    off += align256(static_cast<size_t>(count) * sizeof(T));
  };
  MoeRoutingArrays r;
  take(r.counts, S);
  take(r.offsets, S + 1);
  take(r.tile_offsets, S + 1);
  take(r.active, S);
  take(r.n_active, 1);
  take(r.chunk_base, s.n_chunks() * S);
  take(r.pair_rank, pairs);
  take(r.row_token, pairs);
  take(r.row_weight, pairs);
  take(r.slot_row, pairs);
  *total = off;
  return r;
}

}  // namespace

void moe_check_shape(const MoeRoutingShape& s) {
  BG_CHECK(s.n_tokens >= 0, "moe: n_tokens {} is negative", s.n_tokens);
  BG_CHECK(s.n_experts > 0, "moe: {} experts", s.n_experts);
  BG_CHECK(s.n_slots > 0 && s.n_slots <= kMoeMaxSlots && s.n_slots <= s.n_experts,
           "moe: {} local expert slots (1..min({}, {} experts))", s.n_slots, kMoeMaxSlots, s.n_experts);
  BG_CHECK(s.top_k > 0 && s.top_k <= kMoeMaxTopK && s.top_k <= s.n_experts, "moe: top_k {} of {} experts (<= {})",
           s.top_k, s.n_experts, kMoeMaxTopK);
  BG_CHECK(s.n_pairs() <= INT32_MAX, "moe: {} tokens x top-{} overflow 32-bit row indices", s.n_tokens, s.top_k);
}

size_t moe_routing_bytes(const MoeRoutingShape& s) {
  moe_check_shape(s);
  size_t total = 0;
  layout_at(s, 0, &total);
  return total;
}

MoeRoutingArrays moe_routing_layout(const MoeRoutingShape& s, void* base) {
  moe_check_shape(s);
  BG_CHECK(base != nullptr && reinterpret_cast<uintptr_t>(base) % 64 == 0,
           "moe_routing_layout: base {} must be non-null and 64-byte aligned", base);
  size_t total = 0;
  return layout_at(s, reinterpret_cast<uintptr_t>(base), &total);
}

void moe_dispatch_cpu(const MoeRoutingShape& s, const int32_t* slot_map, const int32_t* ids, const float* weights,
                      const MoeRoutingArrays& r, int64_t live_tokens) {
  moe_check_shape(s);
  const int64_t S = s.n_slots, pairs = s.n_pairs();
  const int64_t live_pairs = live_tokens < 0 ? pairs : std::min(pairs, live_tokens * s.top_k);
  std::vector<int32_t> slot_of(static_cast<size_t>(pairs), -1);
  std::fill(r.counts, r.counts + S, 0);
  for (int64_t i = 0; i < live_pairs; ++i) {
    BG_CHECK(ids[i] >= 0 && ids[i] < s.n_experts, "moe dispatch: routing chose expert {} of {}", ids[i], s.n_experts);
    const int32_t slot = slot_map[ids[i]];
    BG_CHECK(slot < S, "moe dispatch: expert {} maps to slot {} of {}", ids[i], slot, S);
    BG_CHECK(slot >= 0 || !s.all_local, "moe dispatch: expert {} has no slot on this rank", ids[i]);
    slot_of[static_cast<size_t>(i)] = slot;
    if (slot >= 0) ++r.counts[slot];
  }
  // Offsets, tile offsets and the active list, in slot order.
  int32_t rows = 0, tiles = 0, n_active = 0;
  for (int64_t e = 0; e < S; ++e) {
    r.offsets[e] = rows;
    r.tile_offsets[e] = tiles;
    if (r.counts[e] > 0) r.active[n_active++] = static_cast<int32_t>(e);
    rows += r.counts[e];
    tiles += (r.counts[e] + kMoeTileRows - 1) / kMoeTileRows;
  }
  r.offsets[S] = rows;
  r.tile_offsets[S] = tiles;
  *r.n_active = n_active;
  // Stable placement: pairs in (token, k) order within each slot.
  std::vector<int32_t> cursor(r.offsets, r.offsets + S);
  for (int64_t i = 0; i < pairs; ++i) {
    const int32_t slot = slot_of[static_cast<size_t>(i)];
    if (slot < 0) {
      r.slot_row[i] = -1;
      continue;
    }
    const int32_t row = cursor[static_cast<size_t>(slot)]++;
    r.row_token[row] = static_cast<int32_t>(i / s.top_k);
    r.row_weight[row] = weights[i];
    r.slot_row[i] = row;
  }
}

void moe_gather_cpu(const MoeRoutingShape& s, const MoeRoutingArrays& r, const float* x, int64_t dim, float* rows) {
  const int32_t n_rows = r.offsets[s.n_slots];
  for (int32_t row = 0; row < n_rows; ++row) {
    std::memcpy(rows + static_cast<int64_t>(row) * dim, x + static_cast<int64_t>(r.row_token[row]) * dim,
                static_cast<size_t>(dim) * sizeof(float));
  }
}

void moe_experts_cpu(const MoeRoutingShape& s, const MoeRoutingArrays& r, std::span<const MoeExpertCpu> experts,
                     const MoeGluParams& glu, const float* rows, float* y_rows, bool round_h) {
  BG_CHECK(static_cast<int64_t>(experts.size()) == s.n_slots, "moe experts: {} expert weights for {} slots",
           experts.size(), s.n_slots);
  std::vector<float> g, u;
  for (int64_t e = 0; e < s.n_slots; ++e) {
    const int64_t n = r.counts[e];
    if (n == 0) continue;
    const MoeExpertCpu& w = experts[static_cast<size_t>(e)];
    BG_CHECK(w.gate && w.up && w.down, "moe experts: slot {} has rows but no weights", e);
    const int64_t hidden = w.gate->n_in, inter = w.gate->n_out, r0 = r.offsets[e];
    g.resize(static_cast<size_t>(n * inter));
    u.resize(g.size());
    linear_cpu(*w.gate, rows + r0 * hidden, n, g.data());
    linear_cpu(*w.up, rows + r0 * hidden, n, u.data());
    if (glu.kind == MoeGlu::kSwiGlu) {
      swiglu_cpu(g.data(), u.data(), static_cast<int64_t>(g.size()), g.data());
    } else {
      situ_cpu({n, inter, glu.beta, glu.beta_lin}, g.data(), u.data(), g.data());
    }
    if (round_h) {
      for (float& v : g) v = bf16_to_f32(f32_to_bf16(v));
    }
    linear_cpu(*w.down, g.data(), n, y_rows + r0 * w.down->n_out);
  }
}

void moe_combine_cpu(const MoeRoutingShape& s, const MoeRoutingArrays& r, const float* y_rows, int64_t dim,
                     float* out) {
  for (int64_t t = 0; t < s.n_tokens; ++t) {
    float* o = out + t * dim;
    for (int64_t k = 0; k < s.top_k; ++k) {
      const int32_t row = r.slot_row[t * s.top_k + k];
      if (row < 0) continue;  // combined by the exchange on the rank that holds the expert
      const float w = r.row_weight[row];
      const float* y = y_rows + static_cast<int64_t>(row) * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] += w * y[i];
    }
  }
}

}  // namespace bg::ops
