// SwiGLU: out = silu(gate) * up, fp32.
#pragma once

#include <cstdint>

namespace bg::ops {

// gate, up, out: [n] (out may alias gate).
void swiglu_cpu(const float* gate, const float* up, int64_t n, float* out);

}  // namespace bg::ops
