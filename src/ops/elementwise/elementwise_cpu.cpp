// CPU references for the residual add and the sigmoid gate (fp32, elementwise).
#include "ops/elementwise/elementwise.h"

#include <cmath>

#include "core/error.h"

namespace bg::ops {

void add_inplace_cpu(int64_t n, const float* x, float* y) {
  BG_CHECK(n >= 0, "add_inplace_cpu: n {} is negative", n);
  if (n == 0) return;
  BG_CHECK(x && y, "add_inplace_cpu: null pointer with n {}", n);
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void sigmoid_gate_cpu(int64_t n, const float* gate, float* x) {
  BG_CHECK(n >= 0, "sigmoid_gate_cpu: n {} is negative", n);
  if (n == 0) return;
  BG_CHECK(gate && x, "sigmoid_gate_cpu: null pointer with n {}", n);
  // exp(-g) overflows to inf for g < -88: the gate is then exactly 0, as it should be.
  for (int64_t i = 0; i < n; ++i) x[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
}

}  // namespace bg::ops
