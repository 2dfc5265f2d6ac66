// The routed-expert path on the device, without host synchronisation: dispatch (per-expert counts, offsets and the
// stable permutation, computed from the router's ids on the device) -> gather x rows into expert order -> grouped
// expert FFN (gate/up -> GLU -> down) over the permuted rows -> weighted combine back to token order. The same
// grouping as group_by_expert (routed_experts.h): expert e owns permuted rows [offsets[e], offsets[e+1]), in token
// order. Included only by CUDA code, the CUDA backend and GPU tests.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/linear/linear_cuda.h"

namespace bg {

// GLU activation of the experts: SwiGLU (DeepSeek-V3) silu(g) * u, or SiTU (Kimi-K3, ops/situ/situ.h)
// [beta tanh(g / beta) sigmoid(g)] * [beta_lin tanh(u / beta_lin)].
enum class GluActivation : uint8_t { kSwiGLU, kSiTU };

struct GluParams {
  GluActivation kind = GluActivation::kSwiGLU;
  float beta = 4.0f;       // SiTU only
  float beta_lin = 25.0f;  // SiTU only
};

// One expert's weights (POD); the FFN launcher takes a device array of these, [n_experts]. All experts share one
// format (MoeCudaParams::expert_format); gate/up are [inter, hidden], down is [hidden, inter].
struct ExpertWeightsCuda {
  ops::DeviceWeight gate;
  ops::DeviceWeight up;
  ops::DeviceWeight down;
};

// Which FFN kernels run. kAuto: skinny (weight-streaming, decode) when n_tokens <= kMoeSkinnyMaxTokens, so that every
// expert has at most 16 rows; tiled (tensor cores, weights dequantized per tile in shared memory) above. Both are
// correct for any row count; the override exists for tests and benchmarks.
enum class MoeFfnPath : uint8_t { kAuto, kSkinny, kTiled };
inline constexpr int64_t kMoeSkinnyMaxTokens = 16;

// Rows of one tile of the tiled FFN kernel; the dispatch step computes per-expert tile offsets for it.
inline constexpr int kMoeTileRows = 64;
// Flat (token, slot) entries ranked per dispatch block.
inline constexpr int kMoeDispatchChunk = 256;
inline constexpr int64_t kMoeMaxExperts = 4096;

enum class MoeOutType : uint8_t { kBf16, kF32 };

struct MoeCudaParams {
  int64_t n_tokens = 0;   // 0 is valid: dispatch zeroes the counts, the rest launches nothing
  int64_t top_k = 0;
  int64_t n_experts = 0;
  int64_t hidden = 0;     // expert input and output width (DeepSeek-V3: 7168; Kimi-K3: the latent 3584)
  int64_t inter = 0;      // expert intermediate width (2048; 3072)
  WeightFormat expert_format = WeightFormat::kMxfp4;
  GluParams act;
  MoeFfnPath path = MoeFfnPath::kAuto;
  MoeOutType out_type = MoeOutType::kBf16;  // combine output dtype
  bool accumulate = false;                   // combine adds to what `out` holds (in fp32) instead of overwriting
};

// Views into one caller-owned device buffer (moe_workspace_layout). n_slots = n_tokens * top_k.
struct MoeWorkspace {
  int32_t* counts = nullptr;        // [n_experts] rows per expert
  int32_t* offsets = nullptr;       // [n_experts + 1] first permuted row of each expert; offsets[E] = n_slots
  int32_t* tile_offsets = nullptr;  // [n_experts + 1] cumulative ceil(counts / kMoeTileRows)
  int32_t* active = nullptr;        // [n_experts] experts with rows, ascending; first *n_active are valid
  int32_t* n_active = nullptr;      // [1]
  int32_t* chunk_base = nullptr;    // [n_chunks, n_experts] per dispatch chunk: its rows before, per expert
  int32_t* slot_rank = nullptr;     // [n_slots] rank of the slot among its chunk's slots of the same expert
  int32_t* row_token = nullptr;     // [n_slots] source token of each permuted row (group_by_expert's token_idx)
  float* row_weight = nullptr;      // [n_slots] routing weight of each permuted row (slot_weight)
  int32_t* slot_row = nullptr;      // [n_slots] permuted row of slot (t, k), index t * top_k + k
  __nv_bfloat16* x_perm = nullptr;  // [n_slots, hidden] gathered inputs
  __nv_bfloat16* h = nullptr;       // [n_slots, inter] GLU outputs
  __nv_bfloat16* y_perm = nullptr;  // [n_slots, hidden] expert outputs
};

// Throws bg::Error naming the bad field (every launcher calls it first).
void moe_check_params(const MoeCudaParams& p);

// Bytes of the workspace (each part 256-byte aligned) and its layout over `base` (256-byte aligned, e.g. cudaMalloc).
size_t moe_workspace_bytes(const MoeCudaParams& p);
MoeWorkspace moe_workspace_layout(const MoeCudaParams& p, void* base);

// (a) ids [n_tokens, top_k] int32 and weights [n_tokens, top_k] fp32 (device) -> counts, offsets, tile offsets, the
// active list, row_token / row_weight / slot_row. Stable: within an expert, rows follow (token, slot) order, exactly
// like group_by_expert. An id outside [0, n_experts) traps the kernel (a corrupted routing is never dropped quietly).
void moe_dispatch_cuda(const MoeCudaParams& p, const int32_t* expert_ids, const float* weights, const MoeWorkspace& ws,
                       cudaStream_t stream);

// (b) x_perm[row] = x[row_token[row]], x [n_tokens, hidden] bf16.
void moe_gather_cuda(const MoeCudaParams& p, const __nv_bfloat16* x, const MoeWorkspace& ws, cudaStream_t stream);

// (c) h = GLU(x_perm gate_e^T, x_perm up_e^T); y_perm = h down_e^T, for each expert's rows, reading the offsets on the
// device. experts: device array [n_experts]; a descriptor whose shape or format disagrees with p traps the kernel.
void moe_expert_ffn_cuda(const MoeCudaParams& p, const ExpertWeightsCuda* experts, const MoeWorkspace& ws,
                         cudaStream_t stream);

// (d) out[t] = (accumulate ? out[t] : 0) + sum_k row_weight * y_perm[slot_row[t, k]] in fp32, in slot order;
// out [n_tokens, hidden] bf16 or fp32 per p.out_type.
void moe_combine_cuda(const MoeCudaParams& p, const MoeWorkspace& ws, void* out, cudaStream_t stream);

struct MoeCudaArgs {
  const int32_t* expert_ids = nullptr;         // [n_tokens, top_k]
  const float* weights = nullptr;              // [n_tokens, top_k]
  const __nv_bfloat16* x = nullptr;            // [n_tokens, hidden]
  const ExpertWeightsCuda* experts = nullptr;  // [n_experts], device
  void* out = nullptr;                         // [n_tokens, hidden]
};

// (a) -> (b) -> (c) -> (d) on one stream.
void moe_routed_experts_cuda(const MoeCudaParams& p, const MoeCudaArgs& a, const MoeWorkspace& ws,
                             cudaStream_t stream);

}  // namespace bg
