// CUDA KDA gate, q/k L2 norm and beta against their CPU references on bf16-rounded inputs, at Kimi-K3's 96 heads x 128
// and ragged token counts: fp32 outputs (gate, beta) to the fp32 tolerance, bf16 outputs (L2 norm) to bf16's.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "cuda/small_ops_testing.h"
#include "ops/kda_gate/kda_gate_cuda.h"

namespace bg::testing {
namespace {

constexpr int64_t kHeads = 96, kHeadDim = 128;

TEST(KdaGateParity, Gate) {
  BG_REQUIRE_GPU();
  for (int64_t n_tokens : {1, 3, 17, 128, 1000}) {
    const ops::KdaGateParams p{n_tokens, kHeads, kHeadDim, -5.0f};
    const size_t n = static_cast<size_t>(n_tokens * kHeads * kHeadDim);
    std::vector<float> g_raw = random_floats(n, 3.0f, 51);
    std::vector<float> a_log = random_floats(static_cast<size_t>(kHeadDim), 1.0f, 52);  // stored [K]; first H read
    const std::vector<float> dt_bias = random_floats(static_cast<size_t>(kHeads * kHeadDim), 1.0f, 53);
    const cuda::DeviceBuffer d_raw = upload_bf16(g_raw), d_alog = cuda::upload(a_log), d_dt = cuda::upload(dt_bias);
    std::vector<float> ref(n);
    ops::kda_gate_cpu(p, g_raw.data(), a_log.data(), dt_bias.data(), ref.data());
    cuda::DeviceBuffer g = poisoned(n * 4);
    ops::kda_gate_cuda(p, bf16_ptr(d_raw), d_alog.as<float>(), d_dt.as<float>(), g.as<float>(), nullptr);
    sync_device();
    EXPECT_LE(max_rel_error(cuda::download<float>(g, n), ref), kTolF32) << "T " << n_tokens;
  }
}

TEST(KdaGateParity, L2NormQAndKInPlace) {
  BG_REQUIRE_GPU();
  for (int64_t dim : {kHeadDim, int64_t{1536}, int64_t{7}}) {
    for (int64_t n_tokens : {1, 3, 17, 128, 1000}) {
      const int64_t n_rows = n_tokens * (dim == kHeadDim ? kHeads : 2);
      const size_t n = static_cast<size_t>(n_rows * dim);
      std::vector<float> x = random_floats(n, 2.0f, 54);
      for (int64_t d = 0; d < dim; ++d) x[static_cast<size_t>(d)] = 0.0f;  // an all-zero row stays zero
      for (float scale : {1.0f, 1.0f / std::sqrt(static_cast<float>(dim))}) {
        SCOPED_TRACE(::testing::Message() << "T " << n_tokens << " dim " << dim << " scale " << scale);
        const ops::KdaL2NormParams p{n_rows, dim, scale, 1e-6f};
        cuda::DeviceBuffer d_x = upload_bf16(x), out = poisoned(n * 2);
        std::vector<float> ref(n);
        ops::kda_l2norm_cpu(p, x.data(), ref.data());
        ops::kda_l2norm_cuda(p, bf16_ptr(d_x), bf16_ptr(out), nullptr);
        sync_device();
        const std::vector<float> got = download_bf16(out, n);
        EXPECT_LE(max_rel_error(got, ref), kTolBf16Out);
        ops::kda_l2norm_cuda(p, bf16_ptr(d_x), bf16_ptr(d_x), nullptr);
        sync_device();
        EXPECT_EQ(first_mismatch(download_bf16(d_x, n), got), -1);
      }
    }
  }
}

TEST(KdaGateParity, Beta) {
  BG_REQUIRE_GPU();
  for (int64_t n_tokens : {1, 3, 17, 128, 1000}) {
    const size_t n = static_cast<size_t>(n_tokens * kHeads);
    std::vector<float> b = random_floats(n, 4.0f, 55);
    b[0] = -100.0f;
    const cuda::DeviceBuffer d_b = upload_bf16(b);
    cuda::DeviceBuffer beta = poisoned(n * 4);
    std::vector<float> ref(n);
    ops::kda_beta_cpu(static_cast<int64_t>(n), b.data(), ref.data());
    ops::kda_beta_cuda(static_cast<int64_t>(n), bf16_ptr(d_b), beta.as<float>(), nullptr);
    sync_device();
    EXPECT_LE(max_rel_error(cuda::download<float>(beta, n), ref), kTolF32) << "T " << n_tokens;
  }
}

TEST(KdaGateParity, RejectsBadParams) {
  BG_REQUIRE_GPU();
  cuda::DeviceBuffer b(64);
  EXPECT_THROW(ops::kda_gate_cuda({1, 1, 4, 0.0f}, bf16_ptr(b), b.as<float>(), b.as<float>(), b.as<float>(), nullptr),
               Error);
  EXPECT_THROW(ops::kda_l2norm_cuda({1, 0, 1.0f, 1e-6f}, bf16_ptr(b), bf16_ptr(b), nullptr), Error);
  EXPECT_THROW(ops::kda_beta_cuda(-1, bf16_ptr(b), b.as<float>(), nullptr), Error);
}

}  // namespace
}  // namespace bg::testing
