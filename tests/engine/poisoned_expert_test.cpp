// Fault containment on the CPU: a NaN expert fails the requests routed to it and nothing else.
#include "poisoned_expert_testing.h"

namespace bg::testing {
namespace {

TEST(PoisonedExpert, KimiK3FailsOnlyTheRequestsRoutedToIt) { expect_poisoned_expert_contained("kimi_k3", "cpu", {9, 5}); }

TEST(PoisonedExpert, DeepSeekV3FailsOnlyTheRequestsRoutedToIt) {
  expect_poisoned_expert_contained("deepseek_v3", "cpu", {2, 5});
}

TEST(PoisonedExpert, ClearErrorsForExpertsThatDoNotExist) {
  TempDir tmp;
  RandomCheckpointSpec spec;
  spec.arch = "kimi_k3";
  spec.format = "bf16";
  spec.out_dir = tmp.path();
  spec.poison_experts = {{0, 1}};  // layer 0 is dense
  try {
    write_random_checkpoint(spec);
    FAIL() << "poisoning a dense layer did not fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no routed expert 1 in layer 0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace bg::testing
