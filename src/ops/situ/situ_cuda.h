// CUDA SiTU GLU activation on bf16 (fp32 math, rounded once to bf16); same params as the CPU reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/situ/situ.h"

namespace bg::ops {

// out = [beta * tanh(gate / beta) * sigmoid(gate)] * [beta_lin * tanh(up / beta_lin)], elementwise.
//   gate, up, out [T, I] contiguous; out may equal gate or up.
void situ_cuda(const SituParams& p, const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out,
               cudaStream_t stream);

}  // namespace bg::ops
