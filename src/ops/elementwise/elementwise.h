// Small elementwise ops on fp32 (CPU references of the CUDA versions): residual add, sigmoid gating, and the column
// split that hands each part of a fused linear group its output.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace bg::ops {

// y[i] += x[i] for i < n (the residual add). x may equal y.
void add_inplace_cpu(int64_t n, const float* x, float* y);

// x[i] *= 1 / (1 + exp(-gate[i])) for i < n (MLA's sigmoid output gate). gate may equal x.
void sigmoid_gate_cpu(int64_t n, const float* gate, float* x);

// Columns [col0, col0 + cols) of a [rows, src_cols] matrix, copied into the contiguous [rows, cols] matrix at dst
// (of the source's element type).
struct ColumnSlice {
  int64_t col0 = 0, cols = 0;
  void* dst = nullptr;
};
inline constexpr size_t kMaxColumnSlices = 8;

// Throws unless every slice lies inside the source's columns, the pointers are set where anything is copied, and
// there are at most kMaxColumnSlices slices. `who` names the caller in the message.
void check_column_slices(int64_t rows, int64_t src_cols, const void* src, std::span<const ColumnSlice> slices,
                         const char* who);

// dst_i[r, c] = src[r, slice_i.col0 + c] for every slice (float destinations).
void split_columns_cpu(int64_t rows, const float* src, int64_t src_cols, std::span<const ColumnSlice> slices);

}  // namespace bg::ops
