// CUDA embedding lookup: out[t] = table[ids[t]] as bf16, for a bf16 or fp32 table in device memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/embedding/embedding.h"

namespace bg::ops {

// table [vocab, dim], ids [n_tokens] (int32, device), out [n_tokens, dim]. The host validates ids before upload; an id
// outside [0, vocab) that still reaches the kernel never reads out of bounds: its row is written as NaN and, when
// error_flag (device int32) is not null, *error_flag is set to 1 (never cleared here: the caller zeroes it).
void embedding_cuda(const EmbeddingParams& p, const __nv_bfloat16* table, const int32_t* ids, __nv_bfloat16* out,
                    int32_t* error_flag, cudaStream_t stream);
void embedding_cuda(const EmbeddingParams& p, const float* table, const int32_t* ids, __nv_bfloat16* out,
                    int32_t* error_flag, cudaStream_t stream);

}  // namespace bg::ops
