// Picking one request's next token from its logits row: greedy or temperature / top-k / top-p through the request's
// own seeded generator (so the result does not depend on the batch), the logprobs of the unmodified distribution,
// and the stop rules (eos, stop_token_ids, max tokens).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>

#include "ops/sampling/sampling.h"
#include "server/protocol.h"

namespace bg::engine {

inline constexpr int32_t kMaxTopLogprobs = ops::kMaxTopLogprobs;

struct Sampled {
  int32_t token = 0;
  std::optional<proto::TokenLogprob> logprob;  // when params.top_logprobs >= 0
};

// Checks the parameters of a request (the worker's boundary); returns an error message or "".
std::string validate_sampling(const proto::SamplingParams& p, int64_t vocab_size);

// One token from logits [vocab] (fp32). Non-greedy sampling draws exactly one uniform from `rng`; greedy draws none.
// Throws bg::Error on NaN logits.
Sampled sample_next(const proto::SamplingParams& p, const float* logits, int64_t vocab, std::mt19937_64& rng);

// A step's sampling request for a logits row: the parameters, the one uniform of a non-greedy sample drawn from
// `rng` now (none when greedy: the same draws as sample_next), and the logprobs asked for.
ops::RowSampling row_sampling(const proto::SamplingParams& p, int32_t row, std::mt19937_64& rng);

// A sampled row's logprobs as the protocol carries them (r.n_top alternatives).
proto::TokenLogprob to_token_logprob(const ops::RowSample& r);

// The log-softmax of the raw logits at `token` and the `n_top` best alternatives (best first, lower id on ties).
proto::TokenLogprob token_logprobs(const float* logits, int64_t vocab, int32_t token, int32_t n_top);

// "stop" when `token` is eos (unless ignore_eos) or a stop token, else "length" when n_generated reached
// max_new_tokens, else "".
std::string finish_reason_after(const proto::SamplingParams& p, int64_t eos_token_id, int32_t token,
                                int64_t n_generated, int64_t max_new_tokens);

}  // namespace bg::engine
