// CUDA sampling over fp32 logits rows: greedy argmax, and temperature / top-k / top-p sampling that picks the same id
// as sample_token_with_uniform (CPU) for the same uniform u. Deterministic: the same inputs give the same ids.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/sampling/sampling.h"

namespace bg::ops {

struct SamplingBatch {
  int64_t n_rows = 0;  // may be 0
  int64_t vocab = 0;   // 1 .. kSamplingMaxVocab
};

inline constexpr int64_t kSamplingMaxVocab = int64_t{1} << 19;

// ids[r] = argmax of logits[r, :] (the lowest index among equal maxima). A row containing a NaN gives -1.
//   logits [n_rows, vocab] fp32, ids [n_rows] int32 (device).
void argmax_cuda(const SamplingBatch& b, const float* logits, int32_t* ids, cudaStream_t stream);

// ids[r] = sample_token_with_uniform(params[r], logits[r, :], vocab, uniforms[r]), per row on the device:
//   params [n_rows] SamplingParams (device; temperature <= 0 rows are greedy), uniforms [n_rows] fp64 in [0, 1)
//   (host-generated, device), logits [n_rows, vocab] fp32, ids [n_rows] int32.
// A row the CPU would reject (a NaN logit, top_p outside (0, 1], top_k < 0, u outside [0, 1)) or whose largest logit
// is +-inf when sampling gives -1. Probabilities are summed as 2^-44 fixed point (exact, order-free integer sums), so
// the pick matches the CPU's double sums unless u * kept mass lands within ~1e-9 of a boundary between two ids.
void sample_cuda(const SamplingBatch& b, const SamplingParams* params, const float* logits, const double* uniforms,
                 int32_t* ids, cudaStream_t stream);

// One step's sampling (the engine's path): out[i] = sample_rows_cpu's result for rows[i], per row on the device:
//   rows [n_rows] RowSampling (device; each .row indexes logits, checked by the caller with check_row_sampling),
//   logits [any, vocab] fp32, out [n_rows] RowSample (device).
// finite is a block reduction over the whole row (NaN or +-Inf: token -1, finite false, nothing else). The id follows
// sample_cuda (same rounding note; -1 for parameters the CPU rejects). Logprobs (n_top >= 0) are computed here: log Z
// as a double sum over the row (order differs from the CPU's, so a logprob may differ in its last float bit), the
// alternatives as the n_top largest keys, exactly the CPU's ids and order.
void sample_rows_cuda(const SamplingBatch& b, const RowSampling* rows, const float* logits, RowSample* out,
                      cudaStream_t stream);

}  // namespace bg::ops
