// Fault containment on the GPU: a NaN expert fails the requests routed to it, the others return the clean model's
// tokens, and the CUDA context stays usable (the next run in the same process works).
#include "cuda_testing.h"
#include "poisoned_expert_testing.h"

namespace bg::testing {
namespace {

TEST(PoisonedExpertGpu, KimiK3FailsOnlyTheRequestsRoutedToIt) {
  BG_REQUIRE_GPU();
  expect_poisoned_expert_contained("kimi_k3", "cuda", {9, 5});
}

TEST(PoisonedExpertGpu, DeepSeekV3FailsOnlyTheRequestsRoutedToIt) {
  BG_REQUIRE_GPU();
  expect_poisoned_expert_contained("deepseek_v3", "cuda", {2, 5});
}

}  // namespace
}  // namespace bg::testing
