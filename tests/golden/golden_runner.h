// The golden protocol shared by every architecture: prefill + teacher-forced decode against the reference logits,
// free-running greedy decoding against the reference continuation, split prefill against one prefill, and per-layer
// hidden states for diagnosis.
#pragma once

#include "golden/golden_util.h"

namespace bg::testing {

// Reference logit tolerance (max relative error per row) for an fp32 engine, from shared/golden READMEs.
inline constexpr double kLogitTolerance = 1e-4;

struct GoldenReport {
  double max_prefill_err = 0.0;
  double max_decode_err = 0.0;
};

// Prefill the prompt, then feed the continuation one token at a time; every row within kLogitTolerance and the
// argmax of every continuation row equal to the reference token.
inline GoldenReport check_prefill_and_decode(Model& model, const GoldenPrompt& g) {
  GoldenReport rep;
  const int64_t V = model.info().vocab_size;
  const int64_t L = static_cast<int64_t>(g.prompt.size()), total = static_cast<int64_t>(g.tokens.size());
  auto state = make_state(model, 1, total);
  auto seq = state->new_sequence(total);
  std::vector<float> logits(static_cast<size_t>(L * V));
  model.forward(*seq, g.prompt, logits.data());
  for (int64_t t = 0; t < L; ++t) {
    double err = row_rel_error(logits.data() + t * V, g.logits.data() + t * V, V);
    rep.max_prefill_err = std::max(rep.max_prefill_err, err);
    EXPECT_LE(err, kLogitTolerance) << "prefill row " << t;
  }
  std::vector<float> step(static_cast<size_t>(V));
  int32_t prev_argmax = argmax_row(logits.data() + (L - 1) * V, V);
  for (int64_t t = L; t < total; ++t) {
    EXPECT_EQ(prev_argmax, g.tokens[static_cast<size_t>(t)]) << "greedy token at position " << t;
    model.forward(*seq, std::span<const int32_t>(&g.tokens[static_cast<size_t>(t)], 1), step.data());
    double err = row_rel_error(step.data(), g.logits.data() + t * V, V);
    rep.max_decode_err = std::max(rep.max_decode_err, err);
    EXPECT_LE(err, kLogitTolerance) << "decode row " << t;
    prev_argmax = argmax_row(step.data(), V);
  }
  return rep;
}

// Free-running greedy generation from the prompt reproduces the reference continuation.
inline void check_greedy_generation(Model& model, const GoldenPrompt& g) {
  const int64_t V = model.info().vocab_size;
  auto state = make_state(model, 1, static_cast<int64_t>(g.tokens.size()));
  auto seq = state->new_sequence(static_cast<int64_t>(g.tokens.size()));
  std::vector<float> logits(g.prompt.size() * static_cast<size_t>(V));
  model.forward(*seq, g.prompt, logits.data());
  int32_t next = argmax_row(logits.data() + (g.prompt.size() - 1) * static_cast<size_t>(V), V);
  std::vector<float> step(static_cast<size_t>(V));
  for (size_t t = g.prompt.size(); t < g.tokens.size(); ++t) {
    ASSERT_EQ(next, g.tokens[t]) << "free-running greedy diverged at position " << t;
    model.forward(*seq, std::span<const int32_t>(&next, 1), step.data());
    next = argmax_row(step.data(), V);
  }
}

// Prefill split at `cut` (two forward calls) matches the reference logits as one prefill does, and the two runs agree
// with each other within the same bound (they differ only by fp32 rounding: KDA chunks realign at the cut).
inline void check_split_prefill(Model& model, const GoldenPrompt& g, int64_t cut) {
  const int64_t V = model.info().vocab_size, n = static_cast<int64_t>(g.tokens.size());
  std::vector<float> whole(static_cast<size_t>(n * V)), split(whole.size());
  auto state = make_state(model, 2, 2 * n);
  auto a = state->new_sequence(n);
  model.forward(*a, g.tokens, whole.data());
  auto b = state->new_sequence(n);
  std::span<const int32_t> all(g.tokens);
  model.forward(*b, all.subspan(0, static_cast<size_t>(cut)), split.data());
  model.forward(*b, all.subspan(static_cast<size_t>(cut)), split.data() + cut * V);
  for (int64_t t = 0; t < n; ++t) {
    EXPECT_LE(row_rel_error(split.data() + t * V, g.logits.data() + t * V, V), kLogitTolerance)
        << "row " << t << " cut " << cut;
    EXPECT_LE(row_rel_error(split.data() + t * V, whole.data() + t * V, V), kLogitTolerance)
        << "split vs whole, row " << t << " cut " << cut;
  }
}

}  // namespace bg::testing
