// Token sampling from logits rows: greedy, or temperature + top-k + top-p with a seeded generator; and one step's
// sampling over many rows (RowSampling in, RowSample out: the id, a finite flag and requested logprobs), which both
// backends implement (CPU: sample_rows_cpu; CUDA: sample_rows_cuda).
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace bg::ops {

struct SamplingParams {
  float temperature = 0.0f;  // <= 0: greedy
  int64_t top_k = 0;         // 0: all
  float top_p = 1.0f;        // (0, 1]
};

// Greedy: the highest logit, lowest index on ties. NaN logits are an error.
int32_t argmax(const float* logits, int64_t vocab);

// Samples one id with a given uniform u in [0, 1). Candidates are sorted by logit (descending, lower index first on
// ties) and cut to the top k; softmax at the temperature (double); top-p keeps the smallest prefix whose mass reaches
// top_p; then the id whose cumulative kept mass first exceeds u * kept is chosen. The CUDA sampler follows these rules,
// so both choose the same id for the same u (up to rounding of the sums at a boundary). Greedy (temperature <= 0)
// ignores u. NaN logits, u outside [0, 1), top_p outside (0, 1] and negative top_k are errors.
int32_t sample_token_with_uniform(const SamplingParams& p, const float* logits, int64_t vocab, double u);

// The same rules computed by sorting every candidate (no prefix selection): the definition sample_token_with_uniform
// must agree with, for tests and benchmarks.
int32_t sample_token_full_sort(const SamplingParams& p, const float* logits, int64_t vocab, double u);

// The one uniform of a non-greedy sample: u ~ U[0, 1) from the request's generator (what sample_token draws).
inline double draw_uniform(std::mt19937_64& rng) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); }

// Samples one id: draws u ~ U[0, 1) from `rng` (exactly one draw for non-greedy sampling, none for greedy), then
// sample_token_with_uniform.
int32_t sample_token(const SamplingParams& p, const float* logits, int64_t vocab, std::mt19937_64& rng);

// ---- one step's sampling over a batch of logits rows ---------------------------------------------------------------
inline constexpr int32_t kMaxTopLogprobs = 20;

// One row to sample. Plain data: the CUDA backend copies an array of these to the device as it is.
struct RowSampling {
  SamplingParams params;  // temperature <= 0: greedy
  double uniform = 0.0;   // the row's draw in [0, 1) (draw_uniform on the request's generator); unused when greedy
  int32_t row = 0;        // which row of the step's logits [n_rows, vocab]
  int32_t n_top = -1;     // -1: no logprobs; 0..kMaxTopLogprobs: the token's logprob and the n_top best alternatives
};

// The result for one RowSampling. Plain data (copied back from the device as it is).
struct RowSample {
  int32_t token = -1;  // -1 when the row is not finite (nothing else is filled then)
  bool finite = true;  // false: NaN or +-Inf somewhere in the row
  float logprob = 0.0f;  // log-softmax of the raw logits at `token` (when n_top >= 0)
  int32_t n_top = 0;     // alternatives filled: min(n_top, vocab), best first (lower id on equal logits)
  int32_t top_ids[kMaxTopLogprobs] = {};
  float top_logprobs[kMaxTopLogprobs] = {};
};

// Checks a step's rows against logits [n_logit_rows, vocab] (row in range, n_top in [-1, kMaxTopLogprobs], valid
// parameters, uniform in [0, 1) for non-greedy rows); throws bg::Error naming the bad row.
void check_row_sampling(std::span<const RowSampling> rows, int64_t n_logit_rows, int64_t vocab);

// The CPU implementation: out[i] for rows[i] over logits [n_logit_rows, vocab] (host). A non-finite row gives
// {token -1, finite false}; else the id is sample_token_with_uniform (argmax when greedy) and, when asked, the
// logprobs are those of top_logprobs_cpu.
void sample_rows_cpu(std::span<const RowSampling> rows, const float* logits, int64_t n_logit_rows, int64_t vocab,
                     std::span<RowSample> out);

// log-softmax (double) of a finite row at `token` and at its n_top best ids (best first, lower id on equal logits):
// fills out.logprob, out.n_top, out.top_ids and out.top_logprobs. n_top in [0, kMaxTopLogprobs].
void top_logprobs_cpu(const float* logits, int64_t vocab, int32_t token, int32_t n_top, RowSample& out);

// True when every value of the row is finite (no NaN, no +-Inf).
bool row_finite(const float* row, int64_t n);

}  // namespace bg::ops
