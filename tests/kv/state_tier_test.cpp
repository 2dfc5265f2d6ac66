// Host-tier round trips on the CPU backend (the same checks run on CUDA in tests/cuda/state_tier_gpu_test.cpp).
#include "kv/state_tier_testing.h"

namespace bg::testing {
namespace {

TEST(StateTierCpu, OffloadRestoreRoundTrip) {
  auto be = make_backend("cpu");
  offload_restore_round_trip(*be);
}

TEST(StateTierCpu, PrefixOffloadedWhileARequestArrives) {
  auto be = make_backend("cpu");
  prefix_offloaded_while_a_request_arrives(*be);
}

}  // namespace
}  // namespace bg::testing
