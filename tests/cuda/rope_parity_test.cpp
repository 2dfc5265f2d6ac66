// CUDA RoPE against apply_rope_cpu on bf16-rounded inputs: DeepSeek-V3's q (128 heads of 192, rope in the last 64)
// and latent k_pe (one head in a 576 entry), Kimi's NeoX-style halves, positions up to 163839, attention_factor != 1.
// Values outside the rotated slices must come back unchanged.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cuda/small_ops_testing.h"
#include "ops/rope/rope.h"
#include "ops/rope/rope_cuda.h"

namespace bg::testing {
namespace {

ops::RopeTable make_table(int64_t rope_dim, double theta, float attention_factor) {
  ops::RopeTable t;
  for (int64_t i = 0; i < rope_dim / 2; ++i) {
    const double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rope_dim));
    t.inv_freq.push_back(static_cast<float>(i >= rope_dim / 4 ? f / 40.0 : f));  // YaRN-like: the slow half scaled
  }
  t.attention_factor = attention_factor;
  return t;
}

struct Layout {
  const char* name;
  int64_t n_heads, head_stride, token_stride, rope_offset, rope_dim;
  bool interleaved;
};

TEST(RopeParity, RealLayouts) {
  BG_REQUIRE_GPU();
  const Layout layouts[] = {
      {"dsv3 q", 128, 192, 128 * 192, 128, 64, true},
      {"dsv3 k_pe", 1, 576, 576, 512, 64, true},
      {"neox padded", 3, 44, 3 * 44 + 5, 24, 16, false},
      {"neox full head", 64, 128, 64 * 128, 0, 128, false},
  };
  for (const Layout& l : layouts) {
    for (int64_t n_tokens : {1, 3, 17, 128}) {
      SCOPED_TRACE(::testing::Message() << l.name << " tokens " << n_tokens);
      const ops::RopeParams p{n_tokens, l.n_heads, l.head_stride, l.token_stride, l.rope_offset, l.rope_dim,
                              l.interleaved};
      const ops::RopeTable table = make_table(l.rope_dim, 10000.0, 1.0f + 0.0625f * static_cast<float>(l.rope_dim % 3));
      std::mt19937_64 rng(static_cast<uint64_t>(n_tokens));
      std::uniform_int_distribution<int64_t> pos_dist(0, 163839);
      std::vector<int64_t> positions(static_cast<size_t>(n_tokens));
      for (auto& pos : positions) pos = pos_dist(rng);
      positions[0] = n_tokens > 1 ? 163839 : 0;
      const size_t n = static_cast<size_t>(n_tokens * l.token_stride);
      std::vector<float> x = random_floats(n, 1.0f, 31);
      cuda::DeviceBuffer d_x = upload_bf16(x);
      const cuda::DeviceBuffer d_pos = cuda::upload(positions), d_freq = cuda::upload(table.inv_freq);
      std::vector<float> ref = x;
      ops::apply_rope_cpu(p, table, positions.data(), ref.data());
      ops::apply_rope_cuda(p, d_pos.as<int64_t>(), d_freq.as<float>(), table.attention_factor, bf16_ptr(d_x), nullptr);
      sync_device();
      const std::vector<float> got = download_bf16(d_x, n);
      EXPECT_LE(max_rel_error(got, ref), kTolBf16Out);
      // Untouched elements (nope dims, padding) are bit-identical to the input.
      int64_t changed_outside = 0;
      for (size_t i = 0; i < n; ++i) changed_outside += (ref[i] == x[i]) && !(got[i] == x[i]);
      EXPECT_EQ(changed_outside, 0);
    }
  }
}

TEST(RopeParity, RejectsBadParams) {
  BG_REQUIRE_GPU();
  cuda::DeviceBuffer b(64);
  EXPECT_THROW(ops::apply_rope_cuda({1, 1, 8, 8, 0, 7, true}, b.as<int64_t>(), b.as<float>(), 1.0f, bf16_ptr(b),
                                    nullptr),
               Error);
  EXPECT_THROW(ops::apply_rope_cuda({1, 0, 8, 8, 0, 8, true}, b.as<int64_t>(), b.as<float>(), 1.0f, bf16_ptr(b),
                                    nullptr),
               Error);
  EXPECT_NO_THROW(ops::apply_rope_cuda({0, 1, 8, 8, 0, 8, true}, nullptr, nullptr, 1.0f, nullptr, nullptr));
}

}  // namespace
}  // namespace bg::testing
