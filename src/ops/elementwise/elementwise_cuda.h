// CUDA residual add and sigmoid gate on bf16 (fp32 math, one rounding to bf16 per output), and the column split.
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
// The same over x [rows, cols] (packed) with gate's rows gate_ld elements apart (0: cols; more for a strided view,
// e.g. a fused projection's columns). gate must not overlap x unless it is x itself with gate_ld == cols.
void sigmoid_gate_cuda(int64_t rows, int64_t cols, const __nv_bfloat16* gate, int64_t gate_ld, __nv_bfloat16* x,
                       cudaStream_t stream);

// split_columns_cpu on bf16 (bf16 destinations), one launch for all slices; 16-byte copies when every column offset,
// width and pointer allows them. The destinations must not overlap the source.
void split_columns_cuda(int64_t rows, const __nv_bfloat16* src, int64_t src_cols, std::span<const ColumnSlice> slices,
                        cudaStream_t stream);

}  // namespace bg::ops
