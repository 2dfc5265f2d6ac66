// Sampling CPU reference: candidates sorted by logit, top-k cut, softmax at temperature (double), top-p cut (the
// smallest prefix whose mass reaches top_p), then the pick by one uniform u (drawn here, or given by the caller).
#include "ops/sampling/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace bg::ops {

int32_t argmax(const float* logits, int64_t vocab) {
  BG_CHECK(vocab > 0, "argmax over an empty row");
  int64_t best = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    BG_CHECK(!std::isnan(logits[i]), "NaN logit at index {}", i);
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

namespace {

void check_sampling_params(const SamplingParams& p) {
  BG_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "top_p {} must be in (0, 1]", p.top_p);
  BG_CHECK(p.top_k >= 0, "top_k {} must be >= 0", p.top_k);
}

}  // namespace

int32_t sample_token(const SamplingParams& p, const float* logits, int64_t vocab, std::mt19937_64& rng) {
  if (p.temperature <= 0.0f) return argmax(logits, vocab);
  // Every check before the draw: a rejected call leaves the generator untouched.
  check_sampling_params(p);
  for (int64_t i = 0; i < vocab; ++i) BG_CHECK(!std::isnan(logits[i]), "NaN logit at index {}", i);
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  return sample_token_with_uniform(p, logits, vocab, u);
}

int32_t sample_token_with_uniform(const SamplingParams& p, const float* logits, int64_t vocab, double u) {
  if (p.temperature <= 0.0f) return argmax(logits, vocab);
  check_sampling_params(p);
  BG_CHECK(u >= 0.0 && u < 1.0, "uniform {} must be in [0, 1)", u);
  BG_CHECK(vocab > 0, "sampling over an empty row");
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  for (int64_t i = 0; i < vocab; ++i) BG_CHECK(!std::isnan(logits[i]), "NaN logit at index {}", i);
  int64_t k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  ids.resize(static_cast<size_t>(k));
  std::vector<double> probs(ids.size());
  double max_logit = logits[ids[0]], total = 0.0;
  for (size_t i = 0; i < ids.size(); ++i) {
    probs[i] = std::exp((static_cast<double>(logits[ids[i]]) - max_logit) / p.temperature);
    total += probs[i];
  }
  size_t n_keep = ids.size();
  if (p.top_p < 1.0f) {
    double mass = 0.0;
    for (size_t i = 0; i < ids.size(); ++i) {
      mass += probs[i] / total;
      if (mass >= p.top_p) {
        n_keep = i + 1;
        break;
      }
    }
  }
  double kept = 0.0;
  for (size_t i = 0; i < n_keep; ++i) kept += probs[i];
  double left = u * kept;
  for (size_t i = 0; i < n_keep; ++i) {
    left -= probs[i];
    if (left < 0.0) return ids[i];
  }
  return ids[n_keep - 1];
}

}  // namespace bg::ops
