// The low-latency expert exchange's wire layout (DeepEP low-latency style) and its CPU reference. Each rank owns a
// receive region; senders write straight into their peers' regions (shared memory between CPU processes, CUDA IPC
// peer memory between GPUs) and signal arrival with per-slot flags, so no rank ever waits for a host round trip.
//
// One exchange call ("epoch") moves at most max_tokens tokens per rank. Per receiving rank and epoch parity:
//   dispatch slots  [n_local][n_ranks][max_tokens] messages: 16-byte header {src token, k} + the token's row
//                   (fp32 on CPU; FP8 E4M3 codes + one fp32 scale per 128 values on CUDA)
//   dispatch flags  [n_local][n_ranks]: (epoch, rows sent by that source to that slot)
//   combine rows    [max_tokens * top_k] rows (fp32 on CPU, bf16 on CUDA): the expert output of pair (t, k) at
//                   t * top_k + k, written by the rank that holds the expert
//   combine flags   [n_ranks]: (epoch) once a source has written all rows it owes this rank
// Flags carry the epoch, so nothing is cleared between calls; buffers alternate by epoch parity, so a rank that runs
// ahead into the next layer never overwrites what a slower peer is still reading.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ops/moe/moe.h"

namespace bg::ops {

struct LlShape {
  int64_t n_ranks = 1;
  int64_t n_local = 1;     // expert slots per rank (the most any rank holds)
  int64_t max_tokens = 1;  // tokens one rank sends per epoch (M)
  int64_t top_k = 1;
  int64_t hidden = 0;      // row width (values)
  bool fp8 = false;        // dispatch rows as FP8 E4M3 + per-128 fp32 scales (hidden % 128 == 0)
  int64_t row_elem_bytes = 4;  // non-fp8 dispatch rows and combine rows: 4 (fp32) or 2 (bf16)
};

inline constexpr int64_t kLlMsgHeaderBytes = 16;
inline constexpr int64_t kLlFp8Group = 128;

struct LlMsgHeader {
  int32_t src_token;  // the token's row on the sending rank (within the epoch's tokens)
  int32_t k;          // which of the token's top-k choices this is
  int32_t pad[2];
};
static_assert(sizeof(LlMsgHeader) == kLlMsgHeaderBytes);

// Byte offsets inside one rank's region (both parities), every part 256-byte aligned.
struct LlLayout {
  size_t msg_bytes = 0;          // header + dispatch payload
  size_t payload_bytes = 0;
  size_t combine_row_bytes = 0;
  size_t dispatch_slots[2] = {};
  size_t dispatch_flags[2] = {};  // uint32 on CPU, uint64 on CUDA (flag_bytes each)
  size_t combine_rows[2] = {};
  size_t combine_flags[2] = {};
  size_t flag_bytes = 4;
  size_t region_bytes = 0;

  // Message of (local slot, source rank, index) in the dispatch slots of `parity`.
  size_t msg_offset(int parity, int64_t slot, int64_t src, int64_t index, const LlShape& s) const {
    return dispatch_slots[parity] + static_cast<size_t>((slot * s.n_ranks + src) * s.max_tokens + index) * msg_bytes;
  }
  size_t dispatch_flag_offset(int parity, int64_t slot, int64_t src, const LlShape& s) const {
    return dispatch_flags[parity] + static_cast<size_t>(slot * s.n_ranks + src) * flag_bytes;
  }
  size_t combine_row_offset(int parity, int64_t pair) const {
    return combine_rows[parity] + static_cast<size_t>(pair) * combine_row_bytes;
  }
  size_t combine_flag_offset(int parity, int64_t src) const {
    return combine_flags[parity] + static_cast<size_t>(src) * flag_bytes;
  }
};

// Throws bg::Error naming the bad field.
void ll_check_shape(const LlShape& s);
// flag_bytes: 4 for the CPU reference (futex words), 8 for CUDA.
LlLayout ll_layout(const LlShape& s, size_t flag_bytes);

// CPU flags: (epoch mod 2^16) << 16 | (count + 1); count + 1 never 0, so a fresh (zeroed) flag never matches.
inline uint32_t ll_flag_cpu(uint32_t epoch, int64_t count) {
  return ((epoch & 0xFFFFu) << 16) | static_cast<uint32_t>(count + 1);
}
inline bool ll_flag_cpu_is(uint32_t flag, uint32_t epoch) { return (flag >> 16) == (epoch & 0xFFFFu); }
inline int64_t ll_flag_cpu_count(uint32_t flag) { return static_cast<int64_t>(flag & 0xFFFFu) - 1; }

// Where each global expert lives: owner rank and local slot (the placement, as arrays).
struct LlPlacement {
  const int32_t* owner = nullptr;  // [n_experts]
  const int32_t* slot = nullptr;   // [n_experts]
  int64_t n_experts = 0;
};

// ---- CPU reference (fp32 rows) ----------------------------------------------------------------------------------
// The peers' regions as this rank sees them (regions[r] = rank r's region; regions[rank] is this rank's own).
struct LlPeers {
  std::span<std::byte* const> regions;
  int64_t rank = 0;
};

// Writes each valid (t, k) pair of ids [n_tokens, top_k] (an id < 0 is skipped; >= n_experts is an error) with row
// x[t] into its expert's rank, then every flag this rank owes (counts per (destination, slot), zeros included) with
// release stores. The receivers wait; waking them (futex) is the caller's.
void ll_dispatch_send_cpu(const LlShape& s, const LlLayout& l, const LlPlacement& p, uint32_t epoch,
                          const int32_t* ids, const float* x, int64_t n_tokens, const LlPeers& peers);

// The received rows of this rank, packed by local slot (in source-rank order, then arrival order) for the expert
// kernels: fills the routing arrays (counts, offsets, tile offsets, active list) and rows [capacity, hidden], and
// origin[row] = src_rank * max_tokens * top_k + src_token * top_k + k. Call once every dispatch flag has arrived.
void ll_dispatch_unpack_cpu(const LlShape& s, const LlLayout& l, uint32_t epoch, const std::byte* region,
                            int64_t n_local_here, const MoeRoutingArrays& r, float* rows, int32_t* origin);

// Writes y_rows[row] to the combine rows of the rank that sent it (origin), then the combine flag to every rank.
void ll_combine_send_cpu(const LlShape& s, const LlLayout& l, uint32_t epoch, const MoeRoutingArrays& r,
                         int64_t n_local_here, const float* y_rows, const int32_t* origin, const LlPeers& peers);

// out[t] += sum_k weights[t, k] * combine_row(t * top_k + k) in k order (fp32) over valid ids, after every combine
// flag has arrived. Same arithmetic as moe_combine_cpu, so the result equals the loopback's bit for bit.
void ll_combine_reduce_cpu(const LlShape& s, const LlLayout& l, uint32_t epoch, const std::byte* region,
                           const int32_t* ids, const float* weights, int64_t n_tokens, float* out);

// The FP8 dispatch payload's rounding (CUDA ll exchange with fp8 dispatch), in place on one row of `hidden` values
// (hidden % 128 == 0): per group of 128, scale = max|x| / 448 (1 when the group is all zeros), code = e4m3(x / scale)
// (nearest even, saturating at 448), value = bf16(float(code) * scale). What the experts receive for x.
void ll_fp8_roundtrip_cpu(float* row, int64_t hidden);

// Rows the receive side can hold: every source sends each token to at most min(top_k, n_local) of this rank's slots.
inline int64_t ll_recv_capacity(const LlShape& s) {
  return s.n_ranks * s.max_tokens * (s.top_k < s.n_local ? s.top_k : s.n_local);
}

}  // namespace bg::ops
