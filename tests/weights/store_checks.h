// Checks shared by the weight-store tests: a store (or any WeightSource) holds a checkpoint's exact tensors, and a
// golden case read through a running store matches the reference and, bit for bit, the files read directly.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <string>

#include "formats/checkpoint.h"
#include "golden/golden_runner.h"
#include "model/model_testing.h"
#include "weights_testing.h"

namespace bg::testing {

// A golden case's name as a test-name suffix ("kimi_k3/k3-tiny" -> "kimi_k3_k3_tiny").
inline std::string golden_case_test_name(std::string s) {
  for (char& c : s) c = (c == '/' || c == '-') ? '_' : c;
  return s;
}

// Every checkpoint tensor found by name in `store` with the checkpoint's dtype, shape and bytes (and, where the store
// views its segments, 256-byte aligned; an unpacked W4A16 expert's tensors are the source's own memory).
inline void expect_same_tensors(const WeightSource& store, const std::filesystem::path& model, bool aligned = true) {
  auto ckpt = Checkpoint::open(model);
  ASSERT_EQ(store.names().size(), ckpt->names().size());
  for (const std::string& n : ckpt->names()) {
    const auto a = ckpt->get(n);
    const auto b = store.find(n);
    ASSERT_TRUE(b.has_value()) << n;
    EXPECT_TRUE(store.contains(n)) << n;
    EXPECT_EQ(b->dtype, a.dtype) << n;
    EXPECT_EQ(b->shape, a.shape) << n;
    ASSERT_EQ(b->nbytes, a.nbytes) << n;
    EXPECT_EQ(std::memcmp(b->data, a.data, a.nbytes), 0) << n;
    if (aligned) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data) % 256, 0u) << n;
    }
  }
}

// The golden case `name` read through the running store `store`: every prompt within the reference's tolerance, and
// the logits of the files read directly, bit for bit, with each of `resident_fractions` (--resident-experts).
inline void check_golden_through_store(const std::string& name, const std::string& store,
                                       std::initializer_list<double> resident_fractions) {
  GoldenCase gc(golden_dir() / name);
  auto stored = load_model(gc.model_dir(), load_options(store));
  for (int64_t i = 0; i < gc.n_prompts(); ++i) {
    const GoldenReport rep = check_prefill_and_decode(*stored, gc.prompt(i));
    std::printf("%s via store %s, prompt %ld: max rel err prefill %.3g decode %.3g\n", name.c_str(), store.c_str(),
                static_cast<long>(i), rep.max_prefill_err, rep.max_decode_err);
  }
  auto direct = load_model(gc.model_dir());
  const GoldenPrompt p = gc.prompt(0);
  const EngineRun b = run_prefill_then_decode(*direct, p.prompt, 4);
  for (double fraction : resident_fractions) {
    LoadOptions o = load_options(store);
    o.resident_experts = fraction;
    auto m = fraction < 1.0 ? load_model(gc.model_dir(), o) : nullptr;
    const EngineRun a = run_prefill_then_decode(m ? *m : *stored, p.prompt, 4);
    EXPECT_EQ(a.tokens, b.tokens) << "resident " << fraction;
    EXPECT_EQ(a.logits, b.logits) << "resident " << fraction << ": the store holds the checkpoint's bytes";
  }
}

}  // namespace bg::testing
