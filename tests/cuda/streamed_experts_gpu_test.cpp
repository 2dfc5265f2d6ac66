// Streamed experts on the CUDA backend (--resident-experts below 1): the MXFP4 / FP8 golden cases give the very
// logits of the all-resident model, bit for bit, and the pool really copied experts in through the copy stream. Run
// twice: with the default kernels (MXFP4 layers in the W4A16 layout on both sides: a streamed expert's block is packed
// on the device from its copy, the resident ones at load) and with BG_MOE_W4A16=0 (the stage kernels on
// the checkpoint's format on both sides). A dense F32 expert is refused with a clear error (the device holds it as
// bf16).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <tuple>

#include "core/error.h"
#include "cuda/cuda_testing.h"
#include "golden/golden_util.h"
#include "model/model_testing.h"
#include "model/step_model.h"

namespace bg::testing {
namespace {

class StreamedExpertsGpu : public ::testing::TestWithParam<std::tuple<std::string, double, bool>> {};

TEST_P(StreamedExpertsGpu, EqualsTheResidentModelBitForBit) {
  BG_REQUIRE_GPU();
  const auto& [name, fraction, w4a16] = GetParam();
  // Read when a model loads: both models get the same kernels; later tests of the process get the default back.
  if (!w4a16) ::setenv("BG_MOE_W4A16", "0", 1);
  struct Unset {
    ~Unset() { ::unsetenv("BG_MOE_W4A16"); }
  } unset;
  GoldenCase gc(golden_dir() / name);
  LoadOptions resident_options{.device = "cuda"};
  LoadOptions streamed_options{.device = "cuda", .resident_experts = fraction};
  auto resident = load_model(gc.model_dir(), resident_options);
  auto streamed = load_model(gc.model_dir(), streamed_options);
  const auto* sm = dynamic_cast<const StepModel*>(streamed.get());
  ASSERT_TRUE(sm != nullptr && sm->expert_stream() != nullptr);
  for (int64_t i = 0; i < gc.n_prompts(); ++i) {
    const GoldenPrompt p = gc.prompt(i);
    const EngineRun a = run_prefill_then_decode(*streamed, p.prompt, 6);
    const EngineRun b = run_prefill_then_decode(*resident, p.prompt, 6);
    EXPECT_EQ(a.tokens, b.tokens) << name << " prompt " << i;
    EXPECT_EQ(a.logits, b.logits) << name << " prompt " << i << ": streamed experts are copies of the same bytes";
  }
  const moe::ExpertStream::Stats s = sm->expert_stream()->stats();
  EXPECT_GT(s.copies, 0u);
  // MXFP4 experts stream into W4A16 blocks laid out on the device (with the default kernels); FP8 ones as they are.
  const bool laid_out = w4a16 && name.find("fp8") == std::string::npos;
  EXPECT_EQ(sm->expert_stream()->layout_bytes() > 0, laid_out) << name;
  std::printf("%s at %.2f resident: %lu copies (%.2f MB), %lu hits\n", name.c_str(), fraction,
              static_cast<unsigned long>(s.copies), static_cast<double>(s.bytes_copied) / 1e6,
              static_cast<unsigned long>(s.hits));
}

INSTANTIATE_TEST_SUITE_P(Cases, StreamedExpertsGpu,
                         ::testing::Combine(::testing::Values("deepseek_v3/tiny-fp8", "deepseek_v3/tiny-mxfp4",
                                                              "kimi_k3/k3-tiny"),
                                            ::testing::Values(0.0, 0.5), ::testing::Bool()),
                         [](const auto& param_info) {
                           std::string s = std::get<0>(param_info.param);
                           for (char& c : s) c = (c == '/' || c == '-') ? '_' : c;
                           s += std::get<1>(param_info.param) == 0.0 ? "_resident0" : "_resident0_5";
                           return s + (std::get<2>(param_info.param) ? "_w4a16" : "_stage_kernels");
                         });

TEST(StreamedExpertsGpuErrors, DenseF32ExpertsAreRefused) {
  BG_REQUIRE_GPU();
  GoldenCase gc(golden_dir() / "deepseek_v3/tiny-fp32");
  LoadOptions o{.device = "cuda", .resident_experts = 0.5};
  try {
    load_model(gc.model_dir(), o);
    FAIL() << "a dense F32 expert cannot be streamed on CUDA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be streamed"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace bg::testing
