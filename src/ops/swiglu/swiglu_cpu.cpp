// SwiGLU CPU reference.
#include "ops/swiglu/swiglu.h"

#include <cmath>

namespace bg::ops {

void swiglu_cpu(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

}  // namespace bg::ops
