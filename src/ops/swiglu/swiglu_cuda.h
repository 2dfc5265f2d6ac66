// CUDA SwiGLU on bf16: out = silu(gate) * up in fp32, rounded once to bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/swiglu/swiglu.h"

namespace bg::ops {

// gate, up, out: [n] (out may equal gate or up).
void swiglu_cuda(int64_t n, const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out,
                 cudaStream_t stream);

}  // namespace bg::ops
