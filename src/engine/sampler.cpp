// Sampling with logprobs over ops/sampling (which owns the candidate order, top-k / top-p cut and the draw).
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "ops/sampling/sampling.h"

namespace bg::engine {

std::string validate_sampling(const proto::SamplingParams& p, int64_t vocab_size) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    return fmt::format("temperature {} must be a finite number >= 0", p.temperature);
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return fmt::format("top_p {} must be in (0, 1]", p.top_p);
  if (p.top_k < 0) return fmt::format("top_k {} must be >= 0 (0: off)", p.top_k);
  if (p.max_tokens < 1) return fmt::format("max_tokens {} must be >= 1", p.max_tokens);
  if (p.top_logprobs < -1 || p.top_logprobs > kMaxTopLogprobs) {
    return fmt::format("top_logprobs {} must be in [0, {}] (or -1 for none)", p.top_logprobs, kMaxTopLogprobs);
  }
  for (int32_t id : p.stop_token_ids) {
    if (id < 0 || id >= vocab_size) return fmt::format("stop token id {} is outside [0, {})", id, vocab_size);
  }
  return {};
}

Sampled sample_next(const proto::SamplingParams& p, const float* logits, int64_t vocab, std::mt19937_64& rng) {
  Sampled s;
  if (p.temperature <= 0.0f) {
    s.token = ops::argmax(logits, vocab);
  } else {
    const ops::SamplingParams op{p.temperature, p.top_k, p.top_p};
    s.token = ops::sample_token(op, logits, vocab, rng);
  }
  if (p.top_logprobs >= 0) s.logprob = token_logprobs(logits, vocab, s.token, p.top_logprobs);
  return s;
}

ops::RowSampling row_sampling(const proto::SamplingParams& p, int32_t row, std::mt19937_64& rng) {
  ops::RowSampling r;
  r.params = {p.temperature, p.top_k, p.top_p};
  if (p.temperature > 0.0f) r.uniform = ops::draw_uniform(rng);
  r.row = row;
  r.n_top = p.top_logprobs;
  return r;
}

proto::TokenLogprob token_logprobs(const float* logits, int64_t vocab, int32_t token, int32_t n_top) {
  ops::RowSample r;
  r.token = token;
  ops::top_logprobs_cpu(logits, vocab, token, n_top, r);
  return to_token_logprob(r);
}

proto::TokenLogprob to_token_logprob(const ops::RowSample& r) {
  proto::TokenLogprob out;
  out.token = r.token;
  out.logprob = r.logprob;
  for (int32_t i = 0; i < r.n_top; ++i) out.top.emplace_back(r.top_ids[i], r.top_logprobs[i]);
  return out;
}

std::string finish_reason_after(const proto::SamplingParams& p, int64_t eos_token_id, int32_t token,
                                int64_t n_generated, int64_t max_new_tokens) {
  if (!p.ignore_eos && token == eos_token_id) return "stop";
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end()) return "stop";
  if (n_generated >= max_new_tokens) return "length";
  return {};
}

}  // namespace bg::engine
