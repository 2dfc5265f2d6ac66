// CUDA launcher of the grouped W4A16 MXFP4 expert FFN (design: moe_w4a16_cuda.cu): the per-layer device weights (one
// block per expert, layout of moe_w4a16.h, found through a device table of block pointers), the workspace, and the
// launch that reads the device-side dispatch (ops/moe/moe_cuda.h) and writes the weighted combine, or the expert
// rows of an expert-parallel rank. Included only by CUDA code, the CUDA backend and GPU tests.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "backend/cuda/device_buffer.h"
#include "ops/moe/moe_cuda.h"
#include "ops/moe_w4a16/moe_w4a16.h"

namespace bg::ops {

// One MoE layer's experts on the device (POD; the memory is owned elsewhere, e.g. MoeW4a16DeviceLayer). The kernel
// reads slot s's block through blocks[s] when it builds its work list, so a slot can be pointed at another block (a
// streamed expert's buffer) by rewriting one pointer in stream order, and captured graphs stay valid. A null
// pointer for a slot that gets rows raises kMoeErrorBadDescriptor and its rows are skipped.
struct MoeW4a16Weights {
  MoeW4a16LayoutInfo info;
  const void* const* blocks = nullptr;  // device array [info.n_slots]: expert blocks (info.block_bytes, 16-B aligned)
};

// One layer's blocks in one device allocation, its device block table and the table's host mirror.
struct MoeW4a16DeviceLayer {
  MoeW4a16Weights weights;
  cuda::DeviceBuffer storage;
  cuda::DeviceBuffer table;
  std::vector<const void*> host_table;  // what `table` holds: slot s's block, or null
};
// The allocation and block table of a layout whose slots with present[s] get consecutive blocks of `storage` (not
// initialised: the caller packs every one) and the others a null pointer (synchronous; load time).
MoeW4a16DeviceLayer moe_w4a16_device_layer(const MoeW4a16LayoutInfo& info, const std::vector<bool>& present);
// Packs the experts on the host (moe_w4a16_pack) and uploads them into one new device allocation with its block table
// (synchronous; load time).
MoeW4a16DeviceLayer moe_w4a16_upload(std::span<const MoeW4a16ExpertView> experts, int64_t hidden, int64_t inter);
// The same for the present slots of a layout (info: moe_w4a16_layer_info over every expert the layer will hold, so
// the scale shifts fit them all); a null slot gets a null block pointer (a streamed slot, pointed later).
MoeW4a16DeviceLayer moe_w4a16_upload_slots(const MoeW4a16LayoutInfo& info,
                                           std::span<const MoeW4a16ExpertView* const> slots);
// The block table of a contiguous layer at `base` (slot s at s * info.block_bytes), uploaded (synchronous).
cuda::DeviceBuffer moe_w4a16_block_table(const void* base, const MoeW4a16LayoutInfo& info);

// Views into one caller-owned device buffer (moe_w4a16_workspace_layout), sized for one MoeW4a16Params (the launcher
// checks that it is launched with the params it was laid out for). The counters must be zero before the first launch
// (moe_w4a16_workspace_init, once, outside any graph capture); every launch leaves them zero again.
struct MoeW4a16Workspace {
  MoeW4a16Params params;       // what it was laid out for
  int32_t grid = 0;            // persistent CTAs (the device's SM count at layout time)
  int32_t nb_cap = 0;          // n8 token blocks per pass: min(4, ceil(n_tokens / 8))
  int32_t table_entries = 0;   // item table capacity per CTA (dynamic shared memory beside the pipeline)
  int32_t prefix_entries = 0;  // stream-K's pass-tile prefix after the table (0 without stream-K)
  bool stream = false;         // stream-K (MoeWorkspaceGeometry::stream)
  int32_t* counters = nullptr; // [n_counters]: split-K tile counters, per-(token, down item) combine counters, overlap
  int64_t n_counters = 0;
  int32_t* tile_counters = nullptr;
  int32_t* token_counters = nullptr;
  int32_t* expert_ready = nullptr;  // overlap (moe_w4a16_overlaps): gate/up's finished passes per expert slot
  int32_t* overlap_sched = nullptr; // overlap: [0] down's next ticket, [1] down's exited CTAs (the last resets all)
  float* partials = nullptr;   // [n_partial_slots, partial_slot_floats] split-K partial sums, fragment order
  int64_t n_partial_slots = 0;
  int64_t partial_slot_floats = 0;
  int64_t seq_slot_base = 0;   // first of the per-CTA running-sum slots (fixed splits with > 32 tokens)
  __nv_bfloat16* h = nullptr;  // [n_tokens * top_k, inter] GLU outputs, permuted row order
  float* y = nullptr;          // [n_tokens * top_k, hidden] expert outputs (fp32), permuted row order
};

size_t moe_w4a16_workspace_bytes(const MoeW4a16Params& p);
// base: device memory of moe_w4a16_workspace_bytes(p), 256-byte aligned.
MoeW4a16Workspace moe_w4a16_workspace_layout(const MoeW4a16Params& p, void* base);
// Zeroes the counters (stream-ordered memset).
void moe_w4a16_workspace_init(const MoeW4a16Workspace& ws, cudaStream_t stream);

struct MoeW4a16Args {
  const __nv_bfloat16* x = nullptr;  // [n_tokens, hidden] (rows gathered by the dispatch's row_token); rows out: rows
  void* out = nullptr;  // [n_tokens, hidden], bf16 or fp32 (p.out_f32), read too when p.accumulate; rows out: bf16 rows
  // Elements from one row of x to the next (0: hidden): x may be a strided view of a wider buffer (a fused group's
  // part); a multiple of 8 (16-byte rows).
  int64_t x_ld = 0;
};

// out[t] = (accumulate ? out[t] : 0) + sum_k w[t,k] * expert_{e(t,k)}(x[t]) with the dispatch `d` already computed by
// moe_dispatch_cuda for the same n_tokens / top_k / n_experts (only offsets, active, n_active, row_token, row_weight
// and slot_row are read; the dispatch's x_perm / h / y_perm are not used). Two kernels (gate/up + GLU, then down +
// combine), no host synchronisation, no allocation: capturable in a CUDA graph. Deterministic: the same inputs give
// the same bits on every run and replay. With p.rows_out: out[row] = bf16(expert_{slot(row)}(x[row])) for the rows of
// the dispatch (offsets / active / n_active, as an exchange fills them).
void moe_w4a16_cuda(const MoeW4a16Params& p, const MoeW4a16Weights& w, const MoeWorkspace& d,
                    const MoeW4a16Args& args, const MoeW4a16Workspace& ws, cudaStream_t stream);

// One expert's block packed on the device from its checkpoint-format copy (a streamed expert's pool buffer): the bytes
// moe_w4a16_pack_expert writes on the host, with info's scale shifts. `w`: the expert's gate / up / down device
// descriptors (MXFP4, info's shapes). A NaN scale (0xFF) or one the shifts cannot hold raises kMoeErrorBadDescriptor
// in *error_flags (the layer's shifts come from every expert at load, so neither happens with the checkpoint's bytes).
// Stream-ordered; no allocation, no host synchronisation.
void moe_w4a16_pack_cuda(const MoeW4a16LayoutInfo& info, const ExpertWeightsCuda& w, void* block,
                         int32_t* error_flags, cudaStream_t stream);

// The op's params from the MoE layer's (expert_format must be MXFP4; p.path is ignored): the fused combine of an
// all-local routing, or rows out (MoeW4a16Params::rows_out) for the rows an exchange delivered.
MoeW4a16Params moe_w4a16_params(const MoeCudaParams& p, int32_t fixed_splits = 0);
MoeW4a16Params moe_w4a16_rows_params(const MoeCudaParams& p, int32_t fixed_splits = 0);

}  // namespace bg::ops
