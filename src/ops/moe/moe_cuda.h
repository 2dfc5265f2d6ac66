// The MoE stages on the device, without host synchronisation: dispatch (per-slot counts, offsets and the stable
// permutation, computed from the router's ids and the expert -> slot map on the device), gather into slot order, the
// grouped expert FFN (gate/up -> GLU -> down) over each slot's rows, and the weighted combine back to token order. Same
// routing layout and results as the CPU reference (ops/moe/moe.h). Included only by CUDA code, the CUDA backend and
// GPU tests.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/linear/linear_cuda.h"
#include "ops/moe/moe.h"

namespace bg::ops {

// One expert's weights (POD); the FFN launcher takes a device array of these indexed by local slot. All slots share
// one format (MoeCudaParams::expert_format); gate/up are [inter, hidden], down is [hidden, inter].
struct ExpertWeightsCuda {
  DeviceWeight gate;
  DeviceWeight up;
  DeviceWeight down;
};

// Which FFN kernels run. kAuto: skinny (weight-streaming, decode) when n_tokens <= kMoeSkinnyMaxTokens, so that every
// slot has at most 16 rows; tiled (tensor cores, weights dequantized per tile in shared memory) above. Both are
// correct for any row count; the override exists for tests and benchmarks.
enum class MoeFfnPath : uint8_t { kAuto, kSkinny, kTiled };
inline constexpr int64_t kMoeSkinnyMaxTokens = 16;

enum class MoeOutType : uint8_t { kBf16, kF32 };

// Device error flags the MoE kernels raise instead of trapping (the backend reads them at the step's sync; a trap
// would poison the CUDA context). Bits of the int32 word at MoeWorkspace::error_flags.
inline constexpr int32_t kMoeErrorBadExpertId = 1;    // a routed id outside [0, n_experts): the pair is dropped
inline constexpr int32_t kMoeErrorBadDescriptor = 2;  // an expert descriptor disagrees with the launch: block skipped
inline constexpr int32_t kMoeErrorNoSlot = 8;          // all_local, but a routed expert has no slot: the pair is dropped
inline constexpr int32_t kMoeErrorDuplicateExpert = 16;  // a token routed twice to one expert (top-k ids must differ)
// The ll expert exchange (moe/cuda/ll_exchange.cu) received more rows, or a message it cannot read: rows dropped.
inline constexpr int32_t kMoeErrorExchange = 64;
// The W4A16 kernel's overlapped down launch waited 2 s for gate/up's rows of an expert (MoeW4a16Params::overlap): it
// went on without them.
inline constexpr int32_t kMoeErrorOverlapStall = 128;

struct MoeCudaParams {
  MoeRoutingShape shape;  // n_tokens = 0 is valid: dispatch zeroes the counts, the rest launches nothing
  int64_t hidden = 0;     // expert input and output width (DeepSeek-V3: 7168; Kimi-K3: the latent 3584)
  int64_t inter = 0;      // expert intermediate width (2048; 3072)
  WeightFormat expert_format = WeightFormat::kMxfp4;
  MoeGluParams act;
  MoeFfnPath path = MoeFfnPath::kAuto;
  MoeOutType out_type = MoeOutType::kBf16;  // combine output dtype
  bool accumulate = false;                   // combine adds to what `out` holds (in fp32) instead of overwriting
};

// The routing arrays (one buffer, moe_routing_layout) plus the row buffers and the error word, all device memory.
struct MoeWorkspace : MoeRoutingArrays {
  const int32_t* slot_map = nullptr;  // [n_experts] local slot of each global expert, -1 elsewhere
  __nv_bfloat16* x_perm = nullptr;    // [n_pairs, hidden] gathered inputs
  __nv_bfloat16* h = nullptr;         // [n_pairs, inter] GLU outputs
  __nv_bfloat16* y_perm = nullptr;    // [n_pairs, hidden] expert outputs
  int32_t* error_flags = nullptr;     // one int32 (kMoeError* bits), never null
  // Padding rows (dispatch only): when set, token t is padding if live_row0 + t >= *live_tokens (device, read when the
  // dispatch runs: a captured graph's replays each see their step's count). Its pairs are dropped like another rank's
  // (slot_row -1, no error, their ids not read).
  const int32_t* live_tokens = nullptr;
  int32_t live_row0 = 0;
};

// A dispatch workspace in one owning device allocation (routing arrays, slot map, row buffers, error word), for
// tests and benchmarks; the backend lays its own out of backend tensors. slot_map empty: the identity (every expert
// local). Routing arrays and row buffers are poisoned (0xff), the error word zeroed.
struct MoeDispatchBuffers {
  cuda::DeviceBuffer buf;
  MoeWorkspace ws;
  MoeDispatchBuffers(const MoeCudaParams& p, const std::vector<int32_t>& slot_map = {});
  int32_t error_word() const;
};

// Throws bg::Error naming the bad field (every launcher calls it first).
void moe_check_params(const MoeCudaParams& p);

// (a) ids [n_tokens, top_k] int32 and weights [n_tokens, top_k] fp32 (device) -> counts, offsets, tile offsets, the
// active list, row_token / row_weight / slot_row. Stable: within a slot, rows follow (token, k) order, exactly like
// moe_dispatch_cpu. An id outside [0, n_experts) raises kMoeErrorBadExpertId and the pair is dropped.
void moe_dispatch_cuda(const MoeCudaParams& p, const int32_t* expert_ids, const float* weights, const MoeWorkspace& ws,
                       cudaStream_t stream);

// (b) x_perm[row] = x[row_token[row]], x [n_tokens, hidden] bf16, for the rows on this rank.
void moe_gather_cuda(const MoeCudaParams& p, const __nv_bfloat16* x, const MoeWorkspace& ws, cudaStream_t stream);

// (c) h = GLU(x_perm gate_s^T, x_perm up_s^T); y_perm = h down_s^T, for each slot's rows, reading the offsets on the
// device. experts: device array [n_slots]; a descriptor whose shape or format disagrees with p raises
// kMoeErrorBadDescriptor and its block writes nothing.
void moe_expert_ffn_cuda(const MoeCudaParams& p, const ExpertWeightsCuda* experts, const MoeWorkspace& ws,
                         cudaStream_t stream);

// (d) out[t] = (accumulate ? out[t] : 0) + sum_k row_weight * y_perm[slot_row[t, k]] in fp32, in k order, over the
// pairs on this rank; out [n_tokens, hidden] bf16 or fp32 per p.out_type.
void moe_combine_cuda(const MoeCudaParams& p, const MoeWorkspace& ws, void* out, cudaStream_t stream);

}  // namespace bg::ops
