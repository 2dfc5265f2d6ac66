// CUDA sampling of one step's fp32 logits rows: greedy, temperature / top-k / top-p sampling that picks the same id as
// sample_token_with_uniform (CPU) for the same uniform u, finite flags and logprobs. Deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/sampling/sampling.h"

namespace bg::ops {

struct SamplingBatch {
  int64_t n_rows = 0;  // may be 0
  int64_t vocab = 0;   // 1 .. kSamplingMaxVocab
};

inline constexpr int64_t kSamplingMaxVocab = int64_t{1} << 19;

// Device scratch of sample_rows_cuda for a batch (bytes; about 95 KB per row at Kimi's vocabulary).
size_t sample_rows_workspace_bytes(const SamplingBatch& b);

// One step's sampling (the engine's path): out[i] = sample_rows_cpu's result for rows[i], on the device:
//   rows [n_rows] RowSampling (device; each .row indexes logits, checked by the caller with check_row_sampling),
//   logits [any, vocab] fp32, out [n_rows] RowSample (device), workspace of at least sample_rows_workspace_bytes.
// A row spreads over many CTAs (five kernels: statistics, histograms, windows, candidates, the cuts). finite is false for a row with a
// NaN or +-Inf (token -1, nothing else). The id is sample_token_with_uniform's for the same u: probabilities are summed
// as 2^-44 fixed point (exact, order-free integer sums), so it matches the CPU's double sums unless u * kept mass lands
// within ~1e-9 of a boundary between two ids; a row given parameters the CPU rejects gets -1. Logprobs (n_top >= 0):
// log Z is a double sum over the row in fixed 1024-logit blocks (another order than the CPU's, so a logprob may differ
// in its last float bit, but not with the batch), the alternatives are the n_top largest keys, exactly the CPU's ids
// and order. Deterministic and batch invariant: a row's results do not depend on the other rows or on n_rows.
void sample_rows_cuda(const SamplingBatch& b, const RowSampling* rows, const float* logits, RowSample* out,
                      void* workspace, size_t workspace_size, cudaStream_t stream);

}  // namespace bg::ops
