// The host tier on the GPU: copies on the copy stream, ordered after the compute stream when they read device memory,
// and before it when they write it; blocks freed while a copy still reads them are reused only after it (on the
// device). Skipped without a GPU.
#include "cuda/cuda_testing.h"
#include "kv/state_tier_testing.h"

namespace bg::testing {
namespace {

TEST(StateTierGpu, OffloadRestoreRoundTrip) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  offload_restore_round_trip(*be);
}

TEST(StateTierGpu, PrefixOffloadedWhileARequestArrives) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  prefix_offloaded_while_a_request_arrives(*be);
}

// The conv states are bf16 here (the pool's activation dtype): kept byte for byte by a compressed offload.
TEST(StateTierGpu, CompressedOffloadKeepsConvStatesExact) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  compressed_offload_keeps_conv_states_exact(*be, kv::StateCodec::kBF16);
  compressed_offload_keeps_conv_states_exact(*be, kv::StateCodec::kFP8);
}

TEST(StateTierGpu, PinnedHostMemoryAndFences) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  auto host = be->alloc_host(1 << 20);
  Tensor dev = be->alloc({1 << 18}, DType::kF32);
  std::vector<std::byte> want = random_bytes(1 << 20, 3);
  be->write_bytes(dev, want);
  std::fill(host.get(), host.get() + (1 << 20), std::byte{0});
  const HostCopy c{dev, 0, host.get(), 1 << 20};
  const CopyFence f = be->copy_to_host(std::span<const HostCopy>(&c, 1));
  EXPECT_GT(f, 0u);
  be->wait_fence(f);
  EXPECT_TRUE(be->fence_done(f));
  EXPECT_TRUE(std::equal(want.begin(), want.end(), host.get()));
}

}  // namespace
}  // namespace bg::testing
