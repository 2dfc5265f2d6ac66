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

// Bytes of the launch's own workspace (the plan: each touched expert's record and the prefix of its row tiles), for
// p.n_experts slots; 256-byte aligned device memory, no initialisation needed.
size_t moe_w4a16_prefill_workspace_bytes(const MoeW4a16Params& p);

// Throws naming the bad field: the params (p.rows_out must be set: rows in, rows out), the weights' layout and shape,
// and the launch's size limits.
void moe_w4a16_prefill_check(const MoeW4a16Params& p, const MoeW4a16Weights& w);

// For every row r of the dispatch's touched slots (offsets / active / n_active of `d`): h[r] = bf16(GLU(rows[r]
// gate^T, rows[r] up^T)) (fp32 accumulation, the GLU in fp32 on the accumulators) and y[r] = bf16(h[r] down^T) with
// the slot's expert. rows [n_tokens * top_k, hidden], h [.., inter], y [.., hidden], bf16, 4-byte aligned; rows
// outside the touched slots' ranges are neither read nor written. A touched slot without a block raises
// kMoeErrorBadDescriptor in *d.error_flags and its rows are not written. Three launches (plan, gate/up, down),
// stream-ordered, no allocation, no host synchronisation (capturable). Deterministic: a row's bits depend only on the
// row and its expert (each output is one CTA's full-K sum in a fixed order), not on the batch.
void moe_w4a16_prefill_cuda(const MoeW4a16Params& p, const MoeW4a16Weights& w, const MoeWorkspace& d,
                            const __nv_bfloat16* rows, __nv_bfloat16* h, __nv_bfloat16* y, void* workspace,
                            cudaStream_t stream);

}  // namespace bg::ops
