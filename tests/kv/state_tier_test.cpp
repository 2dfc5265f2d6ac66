// Host-tier round trips on the CPU backend (the same checks run on CUDA in tests/cuda/state_tier_gpu_test.cpp).
#include "kv/kda_state_pool.h"
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

// The slot layout: per KDA layer the fp32 recurrent state, then q / k / v's conv states in the activation dtype, each
// padded to 16 bytes; the pool's views and refs point where the layout says.
TEST(StateTierCpu, SlotLayoutFollowsTheActivationDtype) {
  const KdaStateGeometry g{2, 2, 16, 32, 4};  // recurrent 2 x 16 x 16 = 512 floats; conv 32 x 3 = 96 values
  EXPECT_EQ(g.conv_words(4), 96);             // 384 bytes
  EXPECT_EQ(g.conv_words(2), 48);             // 192 bytes
  EXPECT_EQ(g.layer_words(4), 512 + 3 * 96);
  EXPECT_EQ(g.slot_words(2), 2 * (512 + 3 * 48));
  const KdaStateGeometry odd{1, 1, 2, 10, 4};  // conv 10 x 3 = 30 values: 120 / 60 bytes, padded to 128 / 64
  EXPECT_EQ(odd.conv_words(4), 32);
  EXPECT_EQ(odd.conv_words(2), 16);
  StateGeometry sg = tier_test_geometry();
  EXPECT_EQ(sg.state_bytes_per_seq(2), g.slot_words(2) * 4);

  auto be = make_backend("cpu");
  kv::StateManager sm(*be, sg, tier_test_plan(false));
  const KdaStatePool& pool = sm.state_pool();
  EXPECT_EQ(pool.conv_dtype(), DType::kF32);
  EXPECT_EQ(pool.slot_bytes(), sg.kda.slot_words(4) * 4);
  const auto* base = pool.storage().as<float>();
  const int64_t slot = 1, lw = sg.kda.layer_words(4), sw = sg.kda.slot_words(4);
  const Tensor c = pool.conv(static_cast<int32_t>(slot), 1, 2);
  EXPECT_EQ(c.dtype, DType::kF32);
  EXPECT_EQ(c.shape, (Shape{32, 3}));
  EXPECT_EQ(c.as<float>(), base + slot * sw + lw + 512 + 2 * 96);
  const StateRef r = pool.conv_ref(1, 2);
  EXPECT_EQ(r.offset, lw + 512 + 2 * 96);
  EXPECT_EQ(r.slot_stride, sw);
  EXPECT_EQ(pool.recurrent_ref(1).offset, lw);
}

TEST(StateTierCpu, CompressedOffloadKeepsConvStatesExact) {
  auto be = make_backend("cpu");
  compressed_offload_keeps_conv_states_exact(*be, kv::StateCodec::kBF16);
  compressed_offload_keeps_conv_states_exact(*be, kv::StateCodec::kFP8);
}

}  // namespace
}  // namespace bg::testing
