// Small elementwise ops on fp32 (CPU references of the CUDA versions): residual add and sigmoid gating.
#pragma once

#include <cstdint>

namespace bg::ops {

// y[i] += x[i] for i < n (the residual add). x may equal y.
void add_inplace_cpu(int64_t n, const float* x, float* y);

// x[i] *= 1 / (1 + exp(-gate[i])) for i < n (MLA's sigmoid output gate). gate may equal x.
void sigmoid_gate_cpu(int64_t n, const float* gate, float* x);

}  // namespace bg::ops
