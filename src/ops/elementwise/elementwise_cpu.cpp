// CPU references for the residual add, the sigmoid gate (fp32, elementwise) and the column split.
#include "ops/elementwise/elementwise.h"

#include <algorithm>
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

void check_column_slices(int64_t rows, int64_t src_cols, const void* src, std::span<const ColumnSlice> slices,
                         const char* who) {
  BG_CHECK(rows >= 0 && src_cols >= 0, "{}: bad shape [{}, {}]", who, rows, src_cols);
  BG_CHECK(slices.size() <= kMaxColumnSlices, "{}: {} slices (at most {})", who, slices.size(), kMaxColumnSlices);
  for (size_t i = 0; i < slices.size(); ++i) {
    const ColumnSlice& s = slices[i];
    BG_CHECK(s.col0 >= 0 && s.cols >= 0 && s.col0 + s.cols <= src_cols, "{}: slice {} columns [{}, {}) outside "
             "[0, {})", who, i, s.col0, s.col0 + s.cols, src_cols);
    BG_CHECK(rows == 0 || s.cols == 0 || (s.dst != nullptr && src != nullptr), "{}: null pointer in slice {}", who, i);
  }
}

void split_columns_cpu(int64_t rows, const float* src, int64_t src_cols, std::span<const ColumnSlice> slices) {
  check_column_slices(rows, src_cols, src, slices, "split_columns_cpu");
  for (const ColumnSlice& s : slices) {
    auto* dst = static_cast<float*>(s.dst);
    for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * src_cols + s.col0, s.cols, dst + r * s.cols);
  }
}

}  // namespace bg::ops
