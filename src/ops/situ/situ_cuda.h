// CUDA SiTU GLU activation on bf16 (fp32 math, rounded once to bf16); same params as the CPU reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/situ/situ.h"

namespace bg::ops {

// out = [beta * tanh(gate / beta) * sigmoid(gate)] * [beta_lin * tanh(up / beta_lin)], elementwise.
//   gate, up, out [T, I]; out packed (it may equal gate or up when those are packed too); gate_ld / up_ld: elements
//   from one row of gate / up to the next (0: I; more for strided views of a wider buffer, e.g. a fused group's
//   output).
void situ_cuda(const SituParams& p, const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out,
               cudaStream_t stream, int64_t gate_ld = 0, int64_t up_ld = 0);

}  // namespace bg::ops
