// The low-latency exchange layout and its CPU reference (fp32 rows, 32-bit flags).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/moe_exchange/moe_exchange.h"

namespace bg::ops {
namespace {

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

uint32_t* flag_at(std::byte* region, size_t offset) { return reinterpret_cast<uint32_t*>(region + offset); }

void store_release(uint32_t* word, uint32_t v) { std::atomic_ref<uint32_t>(*word).store(v, std::memory_order_release); }

uint32_t load_acquire(const uint32_t* word) {
  return std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(word)).load(std::memory_order_acquire);
}

}  // namespace

void ll_check_shape(const LlShape& s) {
  BG_CHECK(s.n_ranks >= 1 && s.n_local >= 1 && s.n_local <= kMoeMaxSlots, "ll exchange: {} ranks x {} local slots",
           s.n_ranks, s.n_local);
  BG_CHECK(s.max_tokens >= 1 && s.max_tokens <= 65534, "ll exchange: max tokens per rank {} (1..65534)", s.max_tokens);
  BG_CHECK(s.top_k >= 1 && s.top_k <= kMoeMaxTopK, "ll exchange: top_k {}", s.top_k);
  BG_CHECK(s.hidden >= 1, "ll exchange: hidden {}", s.hidden);
  BG_CHECK(!s.fp8 || s.hidden % kLlFp8Group == 0, "ll exchange: FP8 dispatch needs hidden {} to be a multiple of {}",
           s.hidden, kLlFp8Group);
  BG_CHECK(s.row_elem_bytes == 2 || s.row_elem_bytes == 4, "ll exchange: row element of {} bytes", s.row_elem_bytes);
  BG_CHECK(s.n_ranks * s.max_tokens * s.top_k <= INT32_MAX, "ll exchange: origins overflow 32 bits");
}

LlLayout ll_layout(const LlShape& s, size_t flag_bytes) {
  ll_check_shape(s);
  BG_CHECK(flag_bytes == 4 || flag_bytes == 8, "ll exchange: flags of {} bytes", flag_bytes);
  LlLayout l;
  l.flag_bytes = flag_bytes;
  l.payload_bytes = s.fp8 ? static_cast<size_t>(s.hidden + s.hidden / kLlFp8Group * 4)
                          : static_cast<size_t>(s.hidden * s.row_elem_bytes);
  l.msg_bytes = (kLlMsgHeaderBytes + l.payload_bytes + 15) / 16 * 16;  // 16-byte aligned for vector copies
  l.combine_row_bytes = (static_cast<size_t>(s.hidden * s.row_elem_bytes) + 15) / 16 * 16;
  size_t off = 0;
  for (int p = 0; p < 2; ++p) {
    l.dispatch_slots[p] = off;
    off += align256(static_cast<size_t>(s.n_local * s.n_ranks * s.max_tokens) * l.msg_bytes);
    l.dispatch_flags[p] = off;
    off += align256(static_cast<size_t>(s.n_local * s.n_ranks) * flag_bytes);
    l.combine_rows[p] = off;
    off += align256(static_cast<size_t>(s.max_tokens * s.top_k) * l.combine_row_bytes);
    l.combine_flags[p] = off;
    off += align256(static_cast<size_t>(s.n_ranks) * flag_bytes);
  }
  l.region_bytes = off;
  return l;
}

void ll_dispatch_send_cpu(const LlShape& s, const LlLayout& l, const LlPlacement& p, uint32_t epoch,
                          const int32_t* ids, const float* x, int64_t n_tokens, const LlPeers& peers) {
  BG_CHECK(!s.fp8 && s.row_elem_bytes == 4, "ll dispatch (CPU): fp32 rows only");
  BG_CHECK(n_tokens >= 0 && n_tokens <= s.max_tokens, "ll dispatch: {} tokens exceed the {} per rank", n_tokens,
           s.max_tokens);
  BG_CHECK(static_cast<int64_t>(peers.regions.size()) == s.n_ranks, "ll dispatch: {} peer regions for {} ranks",
           peers.regions.size(), s.n_ranks);
  const int parity = static_cast<int>(epoch & 1u);
  std::vector<int64_t> sent(static_cast<size_t>(s.n_ranks * s.n_local), 0);  // [dst, slot]
  const size_t row_bytes = static_cast<size_t>(s.hidden) * sizeof(float);
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t k = 0; k < s.top_k; ++k) {
      const int32_t e = ids[t * s.top_k + k];
      if (e < 0) continue;
      BG_CHECK(e < p.n_experts, "ll dispatch: routing chose expert {} of {}", e, p.n_experts);
      const int32_t dst = p.owner[e], slot = p.slot[e];
      BG_CHECK(dst >= 0 && dst < s.n_ranks && slot >= 0 && slot < s.n_local, "ll dispatch: expert {} placed at rank "
               "{} slot {}", e, dst, slot);
      int64_t& n = sent[static_cast<size_t>(dst * s.n_local + slot)];
      std::byte* msg = peers.regions[static_cast<size_t>(dst)] + l.msg_offset(parity, slot, peers.rank, n, s);
      const LlMsgHeader h{static_cast<int32_t>(t), static_cast<int32_t>(k), {0, 0}};
      std::memcpy(msg, &h, sizeof(h));
      std::memcpy(msg + kLlMsgHeaderBytes, x + t * s.hidden, row_bytes);
      ++n;
    }
  }
  for (int64_t dst = 0; dst < s.n_ranks; ++dst) {
    for (int64_t slot = 0; slot < s.n_local; ++slot) {
      std::byte* region = peers.regions[static_cast<size_t>(dst)];
      store_release(flag_at(region, l.dispatch_flag_offset(parity, slot, peers.rank, s)),
                    ll_flag_cpu(epoch, sent[static_cast<size_t>(dst * s.n_local + slot)]));
    }
  }
}

void ll_dispatch_unpack_cpu(const LlShape& s, const LlLayout& l, uint32_t epoch, const std::byte* region,
                            int64_t n_local_here, const MoeRoutingArrays& r, float* rows, int32_t* origin) {
  const int parity = static_cast<int>(epoch & 1u);
  const size_t row_bytes = static_cast<size_t>(s.hidden) * sizeof(float);
  int32_t row = 0, tiles = 0, n_active = 0;
  for (int64_t slot = 0; slot < n_local_here; ++slot) {
    r.offsets[slot] = row;
    r.tile_offsets[slot] = tiles;
    for (int64_t src = 0; src < s.n_ranks; ++src) {
      const uint32_t flag = load_acquire(flag_at(const_cast<std::byte*>(region),
                                                 l.dispatch_flag_offset(parity, slot, src, s)));
      BG_CHECK(ll_flag_cpu_is(flag, epoch), "ll unpack: slot {} from rank {} has not arrived", slot, src);
      const int64_t n = ll_flag_cpu_count(flag);
      BG_CHECK(n >= 0 && n <= s.max_tokens, "ll unpack: rank {} sent {} rows to slot {}", src, n, slot);
      for (int64_t i = 0; i < n; ++i) {
        const std::byte* msg = region + l.msg_offset(parity, slot, src, i, s);
        LlMsgHeader h;
        std::memcpy(&h, msg, sizeof(h));
        BG_CHECK(h.src_token >= 0 && h.src_token < s.max_tokens && h.k >= 0 && h.k < s.top_k,
                 "ll unpack: bad header (token {}, k {}) from rank {}", h.src_token, h.k, src);
        std::memcpy(rows + static_cast<int64_t>(row) * s.hidden, msg + kLlMsgHeaderBytes, row_bytes);
        origin[row] = static_cast<int32_t>((src * s.max_tokens + h.src_token) * s.top_k + h.k);
        ++row;
      }
    }
    r.counts[slot] = row - r.offsets[slot];
    if (r.counts[slot] > 0) r.active[n_active++] = static_cast<int32_t>(slot);
    tiles += (r.counts[slot] + kMoeTileRows - 1) / kMoeTileRows;
  }
  r.offsets[n_local_here] = row;
  r.tile_offsets[n_local_here] = tiles;
  *r.n_active = n_active;
}

void ll_combine_send_cpu(const LlShape& s, const LlLayout& l, uint32_t epoch, const MoeRoutingArrays& r,
                         int64_t n_local_here, const float* y_rows, const int32_t* origin, const LlPeers& peers) {
  const int parity = static_cast<int>(epoch & 1u);
  const size_t row_bytes = static_cast<size_t>(s.hidden) * sizeof(float);
  const int64_t per_rank = s.max_tokens * s.top_k;
  for (int32_t row = 0; row < r.offsets[n_local_here]; ++row) {
    const int64_t src = origin[row] / per_rank, pair = origin[row] % per_rank;
    std::memcpy(peers.regions[static_cast<size_t>(src)] + l.combine_row_offset(parity, pair),
                y_rows + static_cast<int64_t>(row) * s.hidden, row_bytes);
  }
  for (int64_t dst = 0; dst < s.n_ranks; ++dst) {
    store_release(flag_at(peers.regions[static_cast<size_t>(dst)], l.combine_flag_offset(parity, peers.rank)),
                  ll_flag_cpu(epoch, 0));
  }
}

void ll_combine_reduce_cpu(const LlShape& s, const LlLayout& l, uint32_t epoch, const std::byte* region,
                           const int32_t* ids, const float* weights, int64_t n_tokens, float* out) {
  const int parity = static_cast<int>(epoch & 1u);
  for (int64_t src = 0; src < s.n_ranks; ++src) {
    const uint32_t flag = load_acquire(flag_at(const_cast<std::byte*>(region), l.combine_flag_offset(parity, src)));
    BG_CHECK(ll_flag_cpu_is(flag, epoch), "ll combine: rank {} has not returned its rows", src);
  }
  for (int64_t t = 0; t < n_tokens; ++t) {
    float* o = out + t * s.hidden;
    for (int64_t k = 0; k < s.top_k; ++k) {
      if (ids[t * s.top_k + k] < 0) continue;
      const float w = weights[t * s.top_k + k];
      const auto* y = reinterpret_cast<const float*>(region + l.combine_row_offset(parity, t * s.top_k + k));
      for (int64_t i = 0; i < s.hidden; ++i) o[i] += w * y[i];
    }
  }
}

void ll_fp8_roundtrip_cpu(float* row, int64_t hidden) {
  BG_CHECK(hidden % kLlFp8Group == 0, "ll fp8: hidden {} is not a multiple of {}", hidden, kLlFp8Group);
  for (int64_t g = 0; g < hidden; g += kLlFp8Group) {
    float amax = 0.0f;
    for (int64_t i = g; i < g + kLlFp8Group; ++i) amax = std::max(amax, std::fabs(row[i]));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int64_t i = g; i < g + kLlFp8Group; ++i) {
      row[i] = bf16_to_f32(f32_to_bf16(f8e4m3_to_f32(f32_to_f8e4m3(row[i] / scale)) * scale));
    }
  }
}

}  // namespace bg::ops
