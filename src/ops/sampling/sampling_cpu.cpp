// Sampling CPU reference: candidates sorted by logit, top-k cut, softmax at temperature (double), top-p cut (the
// smallest prefix whose mass reaches top_p), then the pick by one uniform u (drawn here, or given by the caller).
// Without a top-k cut the choice is found from a short sorted prefix (a threshold search, not a sort of the whole
// vocabulary) whenever that provably gives the full sort's id; one step's rows (sample_rows_cpu) add finite flags and logprobs.
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

// The candidate order: logit descending, lower index first on equal logits.
struct ByLogit {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; }
};

// exp((l - max) / T) in double: the weight of a candidate (the same expression on every path).
double weight_of(float logit, double max_logit, float temperature) {
  return std::exp((static_cast<double>(logit) - max_logit) / temperature);
}

// The pick among the first n_keep of `ids` (sorted): the first whose running mass exceeds u * kept.
int32_t pick_in_prefix(std::span<const int32_t> ids, std::span<const double> probs, size_t n_keep, double u) {
  double kept = 0.0;
  for (size_t i = 0; i < n_keep; ++i) kept += probs[i];
  double left = u * kept;
  for (size_t i = 0; i < n_keep; ++i) {
    left -= probs[i];
    if (left < 0.0) return ids[i];
  }
  return ids[n_keep - 1];
}

// The reference rules over candidates `ids` already sorted by ByLogit (the top k of the row).
int32_t pick_from_sorted(const SamplingParams& p, const float* logits, std::span<const int32_t> ids, double u) {
  std::vector<double> probs(ids.size());
  const double max_logit = logits[ids[0]];
  double total = 0.0;
  for (size_t i = 0; i < ids.size(); ++i) {
    probs[i] = weight_of(logits[ids[i]], max_logit, p.temperature);
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
  return pick_in_prefix(ids, probs, n_keep, u);
}

// A margin far above the rounding of any of the sums involved: a sequential double sum of n <= 2^19 positive terms is
// within n * 2^-53 < 6e-11 (relative) of the exact sum, whatever the order. A decision whose margin exceeds this
// fraction of the total is the same under the full sort's summation order.
constexpr double kDecisionSlack = 1e-9;

// Buckets of the candidates by (max - logit) / T, 64 per nat; the last one takes everything from 63.98 nats down (and
// -inf). Monotone in the logit, so the candidates of buckets <= c are a prefix of the sorted order.
constexpr int kBuckets = 4096;
constexpr double kBucketsPerNat = 64.0;

int bucket_of(float logit, double max_logit, float temperature) {
  const double z = (max_logit - static_cast<double>(logit)) / temperature * kBucketsPerNat;
  return z < kBuckets - 1 ? static_cast<int>(z) : kBuckets - 1;
}

// Without a top-k cut: the full sort's id without sorting the vocabulary. One pass sums the weights per bucket; the
// bucket where the running mass passes the target (top_p * total for the cut, u * total for the pick without one)
// bounds a sorted prefix that holds the decision; only that prefix is gathered and sorted. The kept mass and the
// pick inside a top-p prefix use exactly the reference's arithmetic; the totals are summed in another order, so a
// decision within kDecisionSlack of a boundary returns -1 (the caller then sorts everything).
int32_t pick_by_threshold(const SamplingParams& p, const float* logits, int64_t vocab, double u) {
  const double max_logit = logits[argmax(logits, vocab)];
  if (!std::isfinite(max_logit)) return -1;  // +-inf logits: leave them to the reference
  std::vector<double> mass(kBuckets, 0.0);
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    const double w = weight_of(logits[i], max_logit, p.temperature);
    mass[static_cast<size_t>(bucket_of(logits[i], max_logit, p.temperature))] += w;
    total += w;
  }
  if (!std::isfinite(total)) return -1;
  const double slack = kDecisionSlack * total;
  // top_p < 1: the cut is where the running mass reaches top_p * total; top_p == 1: the pick is where it exceeds
  // u * total (every candidate kept).
  const bool cut = p.top_p < 1.0f;
  const double target = cut ? static_cast<double>(p.top_p) * total : u * total;
  int last = kBuckets - 1;
  double run = 0.0;
  for (int b = 0; b < kBuckets; ++b) {
    run += mass[static_cast<size_t>(b)];
    if (run > target + slack) {
      last = b;
      break;
    }
  }
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < vocab; ++i) {
    if (bucket_of(logits[i], max_logit, p.temperature) <= last) ids.push_back(static_cast<int32_t>(i));
  }
  std::sort(ids.begin(), ids.end(), ByLogit{logits});
  run = 0.0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const double before = run;
    run += weight_of(logits[ids[i]], max_logit, p.temperature);
    if (cut ? run < target : run <= target) continue;
    if (run - target <= slack || target - before <= slack) return -1;  // too close to call without the full sums
    if (!cut) return ids[i];
    std::vector<double> probs(i + 1);
    for (size_t j = 0; j <= i; ++j) probs[j] = weight_of(logits[ids[j]], max_logit, p.temperature);
    return pick_in_prefix(ids, probs, probs.size(), u);
  }
  return -1;
}

}  // namespace

int32_t sample_token(const SamplingParams& p, const float* logits, int64_t vocab, std::mt19937_64& rng) {
  if (p.temperature <= 0.0f) return argmax(logits, vocab);
  // Every check before the draw: a rejected call leaves the generator untouched.
  check_sampling_params(p);
  for (int64_t i = 0; i < vocab; ++i) BG_CHECK(!std::isnan(logits[i]), "NaN logit at index {}", i);
  const double u = draw_uniform(rng);
  return sample_token_with_uniform(p, logits, vocab, u);
}

int32_t sample_token_with_uniform(const SamplingParams& p, const float* logits, int64_t vocab, double u) {
  if (p.temperature <= 0.0f) return argmax(logits, vocab);
  check_sampling_params(p);
  BG_CHECK(u >= 0.0 && u < 1.0, "uniform {} must be in [0, 1)", u);
  BG_CHECK(vocab > 0, "sampling over an empty row");
  for (int64_t i = 0; i < vocab; ++i) BG_CHECK(!std::isnan(logits[i]), "NaN logit at index {}", i);
  const int64_t k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  if (k == vocab) {
    if (const int32_t id = pick_by_threshold(p, logits, vocab, u); id >= 0) return id;
  }
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), ByLogit{logits});
  return pick_from_sorted(p, logits, std::span<const int32_t>(ids.data(), static_cast<size_t>(k)), u);
}

int32_t sample_token_full_sort(const SamplingParams& p, const float* logits, int64_t vocab, double u) {
  if (p.temperature <= 0.0f) return argmax(logits, vocab);
  check_sampling_params(p);
  BG_CHECK(u >= 0.0 && u < 1.0 && vocab > 0, "sample_token_full_sort: bad uniform {} or vocab {}", u, vocab);
  const int64_t k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), ByLogit{logits});
  return pick_from_sorted(p, logits, std::span<const int32_t>(ids.data(), static_cast<size_t>(k)), u);
}

// ---- one step's rows ---------------------------------------------------------------------------------------------

bool row_finite(const float* row, int64_t n) {
  // x * 0 is NaN exactly for NaN and +-Inf, so the sum is 0 exactly when every value is finite (one pass, no branch).
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += row[i] * 0.0f;
  return acc == 0.0f;
}

void check_row_sampling(std::span<const RowSampling> rows, int64_t n_logit_rows, int64_t vocab) {
  BG_CHECK(vocab > 0, "sampling rows: empty vocabulary");
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowSampling& r = rows[i];
    BG_CHECK(r.row >= 0 && r.row < n_logit_rows, "sampling rows: entry {} reads logits row {} of {}", i, r.row,
             n_logit_rows);
    BG_CHECK(r.n_top >= -1 && r.n_top <= kMaxTopLogprobs, "sampling rows: entry {} asks for {} logprobs (-1..{})", i,
             r.n_top, kMaxTopLogprobs);
    if (r.params.temperature <= 0.0f) continue;
    BG_CHECK(r.params.top_p > 0.0f && r.params.top_p <= 1.0f && r.params.top_k >= 0,
             "sampling rows: entry {} has top_p {} / top_k {}", i, r.params.top_p, r.params.top_k);
    BG_CHECK(r.uniform >= 0.0 && r.uniform < 1.0, "sampling rows: entry {} has uniform {} outside [0, 1)", i,
             r.uniform);
  }
}

void top_logprobs_cpu(const float* logits, int64_t vocab, int32_t token, int32_t n_top, RowSample& out) {
  BG_CHECK(n_top >= 0 && n_top <= kMaxTopLogprobs && token >= 0 && token < vocab,
           "top_logprobs_cpu: n_top {} or token {} out of range", n_top, token);
  // log p_i = x_i - (max + log sum exp(x - max)), in double.
  double max_logit = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) max_logit = std::max(max_logit, static_cast<double>(logits[i]));
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - max_logit);
  const double log_z = max_logit + std::log(sum);
  auto logprob = [&](int64_t i) { return static_cast<float>(static_cast<double>(logits[i]) - log_z); };
  out.logprob = logprob(token);
  out.n_top = static_cast<int32_t>(std::min<int64_t>(n_top, vocab));
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + out.n_top, ids.end(), ByLogit{logits});
  for (int32_t i = 0; i < out.n_top; ++i) {
    out.top_ids[i] = ids[static_cast<size_t>(i)];
    out.top_logprobs[i] = logprob(ids[static_cast<size_t>(i)]);
  }
}

void sample_rows_cpu(std::span<const RowSampling> rows, const float* logits, int64_t n_logit_rows, int64_t vocab,
                     std::span<RowSample> out) {
  BG_CHECK(out.size() == rows.size(), "sample_rows_cpu: {} results for {} rows", out.size(), rows.size());
  check_row_sampling(rows, n_logit_rows, vocab);
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowSampling& r = rows[i];
    const float* row = logits + static_cast<int64_t>(r.row) * vocab;
    out[i] = RowSample{};
    if (!row_finite(row, vocab)) {
      out[i].finite = false;
      continue;
    }
    out[i].token = sample_token_with_uniform(r.params, row, vocab, r.uniform);
    if (r.n_top >= 0) top_logprobs_cpu(row, vocab, out[i].token, r.n_top, out[i]);
  }
}

}  // namespace bg::ops
