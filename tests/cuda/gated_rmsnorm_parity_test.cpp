// CUDA gated RMSNorm against gated_rmsnorm_cpu on bf16-rounded inputs: Kimi-K3's 96 heads x 128 over ragged token
// counts (a warp per row), a 1536-wide head (a block per row), saturated gates, and in place over x and over gate.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/small_ops_testing.h"
#include "ops/gated_rmsnorm/gated_rmsnorm_cuda.h"

namespace bg::testing {
namespace {

TEST(GatedRmsNormParity, MatchesCpuInAndOutOfPlace) {
  BG_REQUIRE_GPU();
  struct Case {
    int64_t n_heads, head_dim;
  };
  for (const Case c : {Case{96, 128}, Case{2, 1536}, Case{3, 1}}) {
    for (int64_t n_tokens : {1, 3, 17, 128, 1000}) {
      SCOPED_TRACE(::testing::Message() << "T " << n_tokens << " H " << c.n_heads << " D " << c.head_dim);
      const ops::GatedRmsNormParams p{n_tokens, c.n_heads, c.head_dim, 1e-5f};
      const size_t n = static_cast<size_t>(n_tokens * c.n_heads * c.head_dim);
      std::vector<float> x = random_floats(n, 3.0f, 71), gate = random_floats(n, 4.0f, 72);
      gate[0] = -200.0f;  // sigmoid underflows to 0
      std::vector<float> w = random_floats(static_cast<size_t>(c.head_dim), 0.3f, 73);
      for (auto& v : w) v += 1.0f;
      cuda::DeviceBuffer d_x = upload_bf16(x), d_g = upload_bf16(gate), out = poisoned(n * 2);
      const cuda::DeviceBuffer d_w = cuda::upload(w);
      std::vector<float> ref(n);
      ops::gated_rmsnorm_cpu(p, x.data(), gate.data(), w.data(), ref.data());
      ops::gated_rmsnorm_cuda(p, bf16_ptr(d_x), bf16_ptr(d_g), d_w.as<float>(), bf16_ptr(out), nullptr);
      sync_device();
      const std::vector<float> got = download_bf16(out, n);
      EXPECT_LE(max_rel_error(got, ref), kTolBf16Out);
      cuda::DeviceBuffer x2 = upload_bf16(x);
      ops::gated_rmsnorm_cuda(p, bf16_ptr(x2), bf16_ptr(d_g), d_w.as<float>(), bf16_ptr(x2), nullptr);  // over x
      ops::gated_rmsnorm_cuda(p, bf16_ptr(d_x), bf16_ptr(d_g), d_w.as<float>(), bf16_ptr(d_g), nullptr);  // over gate
      sync_device();
      EXPECT_EQ(first_mismatch(download_bf16(x2, n), got), -1);
      EXPECT_EQ(first_mismatch(download_bf16(d_g, n), got), -1);
    }
  }
}

// The gate as a strided column view of a wider [T, ld] buffer (a fused group's output read in place): the same bits
// as from a packed copy of it.
TEST(GatedRmsNormParity, ReadsAStridedGate) {
  BG_REQUIRE_GPU();
  for (const int64_t n_tokens : {1, 7, 64}) {
    const int64_t heads = 6, dim = 128, width = heads * dim, ld = 3 * width + 40, col0 = width + 8;
    const ops::GatedRmsNormParams p{n_tokens, heads, dim, 1e-5f};
    const auto n = static_cast<size_t>(n_tokens * width);
    std::vector<float> x = random_floats(n, 3.0f, 81);
    std::vector<float> all = random_floats(static_cast<size_t>(n_tokens * ld), 4.0f, 82);
    std::vector<float> gate(n);
    for (int64_t t = 0; t < n_tokens; ++t) {
      for (int64_t c = 0; c < width; ++c) {
        gate[static_cast<size_t>(t * width + c)] = all[static_cast<size_t>(t * ld + col0 + c)];
      }
    }
    std::vector<float> w = random_floats(static_cast<size_t>(dim), 0.3f, 83);
    const cuda::DeviceBuffer d_x = upload_bf16(x), d_all = upload_bf16(all), d_g = upload_bf16(gate);
    const cuda::DeviceBuffer d_w = cuda::upload(w);
    cuda::DeviceBuffer want = poisoned(n * 2), got = poisoned(n * 2);
    ops::gated_rmsnorm_cuda(p, bf16_ptr(d_x), bf16_ptr(d_g), d_w.as<float>(), bf16_ptr(want), nullptr);
    ops::gated_rmsnorm_cuda(p, bf16_ptr(d_x), bf16_ptr(d_all) + col0, d_w.as<float>(), bf16_ptr(got), nullptr, ld);
    sync_device();
    EXPECT_EQ(first_mismatch(download_bf16(got, n), download_bf16(want, n)), -1) << "T " << n_tokens;
  }
  cuda::DeviceBuffer b(4096);
  // A gate row shorter than a token's heads, and y over a strided gate, are refused.
  EXPECT_THROW(ops::gated_rmsnorm_cuda({1, 2, 4, 1e-5f}, bf16_ptr(b), bf16_ptr(b), b.as<float>(), bf16_ptr(b) + 64,
                                       nullptr, 4),
               Error);
  EXPECT_THROW(ops::gated_rmsnorm_cuda({2, 2, 4, 1e-5f}, bf16_ptr(b), bf16_ptr(b), b.as<float>(), bf16_ptr(b), nullptr,
                                       16),
               Error);
}

TEST(GatedRmsNormParity, RejectsBadParams) {
  BG_REQUIRE_GPU();
  cuda::DeviceBuffer b(64);
  EXPECT_THROW(ops::gated_rmsnorm_cuda({1, 0, 4, 1e-5f}, bf16_ptr(b), bf16_ptr(b), b.as<float>(), bf16_ptr(b), nullptr),
               Error);
  EXPECT_THROW(ops::gated_rmsnorm_cuda({1, 1, 4, 0.0f}, bf16_ptr(b), bf16_ptr(b), b.as<float>(), bf16_ptr(b), nullptr),
               Error);
  EXPECT_NO_THROW(ops::gated_rmsnorm_cuda({0, 1, 4, 1e-5f}, nullptr, nullptr, nullptr, nullptr, nullptr));
}

}  // namespace
}  // namespace bg::testing
