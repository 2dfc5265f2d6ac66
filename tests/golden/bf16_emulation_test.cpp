// The golden models' own bf16 sensitivity, measured without a GPU: the CPU backend with bf16 emulation ("cpu-bf16":
// rounding to bf16 exactly where the CUDA backend stores bf16) under the fp32 reference's expert choices. Its
// distance from the float64 goldens is what any correct bf16 engine must be allowed, and it is what the GPU golden
// test's per-architecture bounds are checked against (tests/cuda/golden_gpu_test.cpp, docs/GPU.md).
#include <gtest/gtest.h>

#include <cstdio>

#include "golden/golden_util.h"
#include "model/model.h"

namespace bg::testing {
namespace {

struct Case {
  std::string arch, name;
};

class Bf16Emulation : public ::testing::TestWithParam<Case> {};

TEST_P(Bf16Emulation, WithinTheGpuBoundUnderReferenceRouting) {
  const Case& c = GetParam();
  GoldenCase gc(golden_dir() / c.arch / c.name);
  LoadOptions o;
  auto ref = load_model(gc.model_dir(), o);
  o.device = "cpu-bf16";
  auto emu = load_model(gc.model_dir(), o);
  auto ref_state = make_state(*ref, 1, 4096), emu_state = make_state(*emu, 1, 4096);
  const int64_t V = ref->info().vocab_size;
  double worst_all = 0.0;
  for (int64_t i = 0; i < gc.n_prompts(); ++i) {
    GoldenPrompt g = gc.prompt(i);
    RoutingTape routing;
    ref->set_route_hook(routing.recorder());
    // One prefill of the whole golden sequence on each (the rows are the golden's teacher-forced rows).
    std::vector<float> a(g.tokens.size() * static_cast<size_t>(V)), b(a.size());
    auto sa = ref_state->new_sequence(static_cast<int64_t>(g.tokens.size()));
    ref->forward(*sa, g.tokens, a.data());
    emu->set_route_hook(routing.replayer());
    auto sb = emu_state->new_sequence(static_cast<int64_t>(g.tokens.size()));
    emu->forward(*sb, g.tokens, b.data());
    EXPECT_EQ(routing.next, routing.records.size());
    double worst = 0.0, worst_ref = 0.0;
    for (size_t t = 0; t < g.tokens.size(); ++t) {
      worst = std::max(worst, row_rel_error(b.data() + t * V, g.logits.data() + t * V, V));
      worst_ref = std::max(worst_ref, row_rel_error(a.data() + t * V, g.logits.data() + t * V, V));
    }
    EXPECT_LE(worst_ref, 1e-4) << "the fp32 reference itself";
    EXPECT_LE(worst, bf16_logit_bound(c.arch)) << c.name << " prompt " << i;
    worst_all = std::max(worst_all, worst);
    std::printf("[bf16 emulation] %s/%s prompt %ld: max rel err %.3e vs golden (fp32 reference %.1e)\n",
                c.arch.c_str(), c.name.c_str(), static_cast<long>(i), worst, worst_ref);
  }
  EXPECT_GT(worst_all, 1e-3) << "bf16 emulation left the model at fp32 accuracy: it rounds nothing";
}

INSTANTIATE_TEST_SUITE_P(Cases, Bf16Emulation,
                         ::testing::Values(Case{"deepseek_v3", "tiny-fp32"}, Case{"deepseek_v3", "tiny-mxfp4"},
                                           Case{"kimi_k3", "k3-tiny"}, Case{"kimi_k3", "k3-tiny-long"}),
                         [](const auto& p) {
                           std::string s = p.param.name;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace bg::testing
