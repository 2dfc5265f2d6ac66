// CUDA residual add and sigmoid gate on bf16 (fp32 math, one rounding to bf16 per output).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/elementwise/elementwise.h"

namespace bg::ops {

// y[i] = bf16(float(y[i]) + float(x[i])) for i < n. x may equal y.
void add_inplace_cuda(int64_t n, const __nv_bfloat16* x, __nv_bfloat16* y, cudaStream_t stream);

// x[i] = bf16(float(x[i]) * (1 / (1 + exp(-float(gate[i]))))) for i < n. gate may equal x.
void sigmoid_gate_cuda(int64_t n, const __nv_bfloat16* gate, __nv_bfloat16* x, cudaStream_t stream);

}  // namespace bg::ops
