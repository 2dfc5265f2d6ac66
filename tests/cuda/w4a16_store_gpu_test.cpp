// A weight store holding MXFP4 experts as W4A16 blocks (--expert-layout w4a16), read by the CUDA engine with
// BG_STORE_W4A16_DIRECT=1 (the default): the experts are bound deferred and their blocks go to the GPU as they are (resident ones
// into the layer's allocation, streamed ones straight into their pool buffer's block, nothing packed), and the logits
// are bit-identical to the model read from the files (whose layout is packed at load from the same bytes), with every
// expert resident and with half of them streamed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <tuple>

#include "cuda/cuda_testing.h"
#include "golden/golden_util.h"
#include "model/model_testing.h"
#include "model/step_model.h"
#include "weights/weights_testing.h"

namespace bg::testing {
namespace {

class W4a16StoreGpu : public ::testing::TestWithParam<std::tuple<std::string, double>> {};

TEST_P(W4a16StoreGpu, BlocksCopiedAsTheyAreGiveTheFilesLogits) {
  BG_REQUIRE_GPU();
  const auto& [name, fraction] = GetParam();
  GoldenCase gc(golden_dir() / name);
  StoreGuard g;
  weights::DaemonOptions dopt = daemon_options(gc.model_dir(), g.name());
  dopt.build.expert_layout = weights::ExpertLayout::kW4a16;
  InProcessDaemon d(dopt);
  ASSERT_EQ(d.wait_ready(), "");
  LoadOptions files{.device = "cuda", .resident_experts = fraction};
  auto from_files = load_model(gc.model_dir(), files);
  LoadOptions stored = files;
  stored.weight_store = g.name();
  ::setenv("BG_STORE_W4A16_DIRECT", "1", 1);
  struct Unset {
    ~Unset() { ::unsetenv("BG_STORE_W4A16_DIRECT"); }
  } unset;
  ASSERT_TRUE(bind_options(stored).defer_w4a16_experts);
  auto from_store = load_model(gc.model_dir(), stored);
  for (int64_t i = 0; i < gc.n_prompts(); ++i) {
    const GoldenPrompt p = gc.prompt(i);
    const EngineRun a = run_prefill_then_decode(*from_store, p.prompt, 6);
    const EngineRun b = run_prefill_then_decode(*from_files, p.prompt, 6);
    EXPECT_EQ(a.tokens, b.tokens) << name << " prompt " << i;
    EXPECT_EQ(a.logits, b.logits) << name << " prompt " << i << ": the store's blocks are the packed layout's bytes";
  }
  if (fraction < 1.0) {
    const auto* sm = dynamic_cast<const StepModel*>(from_store.get());
    ASSERT_TRUE(sm != nullptr && sm->expert_stream() != nullptr);
    const moe::ExpertStream::Stats s = sm->expert_stream()->stats();
    EXPECT_GT(s.copies, 0u);
    ASSERT_GT(sm->expert_stream()->layout_bytes(), 0u);
    EXPECT_EQ(s.bytes_copied, s.copies * sm->expert_stream()->layout_bytes()) << "every copy was one block";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, W4a16StoreGpu,
                         ::testing::Combine(::testing::Values("deepseek_v3/tiny-mxfp4", "kimi_k3/k3-tiny"),
                                            ::testing::Values(1.0, 0.5)),
                         [](const auto& param_info) {
                           std::string s = std::get<0>(param_info.param);
                           for (char& c : s) c = (c == '/' || c == '-') ? '_' : c;
                           return s + (std::get<1>(param_info.param) == 1.0 ? "_resident" : "_half_streamed");
                         });

}  // namespace
}  // namespace bg::testing
