// The W4A16 MXFP4 expert FFN for prefill-sized row counts (hundreds to thousands of rows per expert): rows in, rows
// out, on wgmma with the weights dequantized in registers (design: moe_w4a16_prefill_cuda.cu, docs/MOE_PREFILL.md).
// It reads the decode kernel's weight layout (one MoeW4a16Weights per layer, no second copy) and the dispatch's
// device-side offsets, so it needs no host synchronisation and no weight scratch. Included only by CUDA code, the
// CUDA backend and GPU tests.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/moe/moe_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"

namespace bg::ops {

// Bytes of the launch's own workspace (the plan: each touched expert's record and the prefix of its row tiles, for
// p.n_experts slots; then the input rows in the kernel's permuted layout: n_tokens rows with `gather`, else
// n_tokens * top_k, each padded to whole 64-input stages); 256-byte aligned device memory, no initialisation needed.
size_t moe_w4a16_prefill_workspace_bytes(const MoeW4a16Params& p, bool gather);
// The row width of h (MoeW4a16PrefillIo::h): inter padded to whole 64-input stages (inter itself when it is a multiple
// of 64, as for K3 and DeepSeek-V3).
int64_t moe_w4a16_prefill_h_width(const MoeW4a16Params& p);

// Throws naming the bad field: the params (p.rows_out must be set: rows in, rows out), the weights' layout and shape,
// and the launch's size limits.
void moe_w4a16_prefill_check(const MoeW4a16Params& p, const MoeW4a16Weights& w);

// The launch's inputs, outputs and workspace (device memory).
struct MoeW4a16PrefillIo {
  // gather = false: the rows [n_tokens * top_k, hidden] in the dispatch's row order (its x_perm, or the rows an
  // exchange delivered); gather = true: the tokens [n_tokens, hidden], row r read from x[d.row_token[r]] inside the
  // kernel's copies (the dispatch's gather fused: no x_perm pass, no rows buffer).
  const __nv_bfloat16* x = nullptr;
  bool gather = false;
  // [n_tokens * top_k, moe_w4a16_prefill_h_width(p)] the GLU outputs in the kernel's permuted layout, 16-byte
  // aligned (scratch between the two kernels: not in column order)
  __nv_bfloat16* h = nullptr;
  __nv_bfloat16* y = nullptr;  // [n_tokens * top_k, hidden] each row's expert output
  void* workspace = nullptr;   // moe_w4a16_prefill_workspace_bytes(p, gather), 256-byte aligned
};

// For every row r of the dispatch's touched slots (offsets / active / n_active of `d`): h[r] = bf16(GLU(x_r gate^T,
// x_r up^T)) (fp32 accumulation, the GLU in fp32 on the accumulators) and y[r] = bf16(h[r] down^T) with the slot's
// expert, x_r the row (or, with gather, its token's x). x and y bf16, 4-byte aligned; rows of y outside the touched
// slots' ranges are not written. x is first copied into the workspace in the kernel's permuted layout (one pass). A
// touched slot without a block raises kMoeErrorBadDescriptor in *d.error_flags and its rows are not written. Four
// launches (plan, permute, gate/up, down), stream-ordered, no allocation, no host synchronisation (capturable).
// Deterministic run to run: each output is one CTA's full-K sum in a fixed order (no atomics).
void moe_w4a16_prefill_cuda(const MoeW4a16Params& p, const MoeW4a16Weights& w, const MoeWorkspace& d,
                            const MoeW4a16PrefillIo& io, cudaStream_t stream);

}  // namespace bg::ops
