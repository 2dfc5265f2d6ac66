// y = x W^T for a weight in its stored format (dense, FP8 block, MXFP4), fp32 accumulation; and embedding lookup.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "formats/quant.h"

namespace bg::ops {

// x: [n_tokens, w.n_in], y: [n_tokens, w.n_out] (must not alias x).
void linear_cpu(const QuantWeight& w, const float* x, int64_t n_tokens, float* y);

// y[t] = table[ids[t]] as fp32; table [vocab, dim] (F32/BF16/F16). Ids out of range are an error.
void embedding_cpu(const TensorView& table, const int32_t* ids, int64_t n_tokens, float* y);

}  // namespace bg::ops
