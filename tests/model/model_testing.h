// Helpers shared by the model tests: a self-deleting temp dir, "throws bg::Error saying X", file bytes, and the
// engine protocol (prefill a prompt, then greedy decode steps) whose logit rows the tests compare.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <source_location>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "error_testing.h"
#include "temp_dir.h"
#include "golden/golden_util.h"
#include "model/model.h"

namespace bg::testing {

inline std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs f, which must throw bg::Error; returns its message (error_testing.h).
template <typename F>
std::string bg_error_of(F&& f, std::source_location loc = std::source_location::current()) {
  return testing::error_of(std::forward<F>(f), loc);
}

// What the engine computed for prompt + greedy continuation: tokens [n_prompt + n_decode] and logits rows
// [tokens.size(), vocab] (row t = logits after token t; rows >= n_prompt come from single-token decode steps).
struct EngineRun {
  std::vector<int32_t> tokens;
  std::vector<float> logits;
  int64_t n_prompt = 0;
};

inline EngineRun run_prefill_then_decode(Model& model, const std::vector<int32_t>& prompt, int64_t n_decode) {
  const int64_t V = model.info().vocab_size, L = static_cast<int64_t>(prompt.size());
  EngineRun r;
  r.tokens = prompt;
  r.n_prompt = L;
  r.logits.resize(static_cast<size_t>((L + n_decode) * V));
  auto state = make_state(model, 1, L + n_decode);
  auto seq = state->new_sequence(L + n_decode);
  model.forward(*seq, prompt, r.logits.data());
  for (int64_t t = L; t < L + n_decode; ++t) {
    int32_t next = argmax_row(r.logits.data() + (t - 1) * V, V);
    r.tokens.push_back(next);
    model.forward(*seq, std::span<const int32_t>(&r.tokens.back(), 1), r.logits.data() + t * V);
  }
  return r;
}

inline bool all_finite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

}  // namespace bg::testing
