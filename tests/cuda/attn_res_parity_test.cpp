// CUDA Attention-Residual mix (the cluster kernel and the block kernel) against attn_res_mix_cpu on bf16-rounded
// candidates: 1 .. 16 candidates of very different scales, hidden 7168 (16-byte loads), rows split over 1 to 8 CTAs
// and one past the cluster kernel's 16384, dims that are not a multiple of 8 (scalar loads), ragged token
// counts (up to 70,000), a single 16-byte vector per token, large scores (softmax must subtract its max), an all-zero
// candidate row, and the output written over the last candidate (the partial sum). The fused mix + RMSNorm writes the
// same h bit for bit and x as rmsnorm_cuda of it; with the residual update folded in, the bank, h and x are bit for
// bit the separate add (or copy) and mix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

#include "cuda/small_ops_testing.h"
#include "ops/attn_res/attn_res_cuda.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/rmsnorm/rmsnorm_cuda.h"

namespace bg::testing {
namespace {

constexpr ops::AttnResKernel kKernels[] = {ops::AttnResKernel::kCluster, ops::AttnResKernel::kBlock};
const char* kernel_name(ops::AttnResKernel k) { return k == ops::AttnResKernel::kCluster ? " cluster" : " block"; }

struct MixCase {
  int64_t n_candidates, n_tokens, dim;
  float proj_scale;
};

// Every case on both kernels.
template <size_t N>
std::vector<std::pair<MixCase, ops::AttnResKernel>> with_kernels(const MixCase (&cases)[N]) {
  std::vector<std::pair<MixCase, ops::AttnResKernel>> all;
  for (const MixCase& c : cases) {
    for (const ops::AttnResKernel k : kKernels) all.emplace_back(c, k);
  }
  return all;
}

TEST(AttnResParity, MatchesCpu) {
  BG_REQUIRE_GPU();
  const MixCase cases[] = {{1, 3, 7168, 1.0f},   {9, 1, 7168, 1.0f},  {9, 17, 7168, 1.0f}, {10, 128, 7168, 1.0f},
                           {16, 5, 256, 30.0f},  {5, 1000, 128, 1.0f}, {2, 7, 1, 1.0f},     {3, 17, 1000, 0.01f},
                           {4, 9, 7172, 1.0f},   {16, 2, 12288, 1.0f},
                           {2, 3, 8, 1.0f},      {3, 70000, 64, 1.0f},  {2, 4, 2056, 1.0f},  {5, 3, 16384, 1.0f},
                           {3, 2, 16392, 1.0f}};
  for (const auto& [c, kernel] : with_kernels(cases)) {
    SCOPED_TRACE(::testing::Message() << "n " << c.n_candidates << " T " << c.n_tokens << " D " << c.dim
                                      << kernel_name(kernel));
    const size_t per = static_cast<size_t>(c.n_tokens * c.dim), total = per * static_cast<size_t>(c.n_candidates);
    std::vector<float> packed = random_floats(total, 1.0f, static_cast<uint64_t>(c.n_candidates * 100 + c.n_tokens));
    for (int64_t i = 0; i < c.n_candidates; ++i) {
      const float scale = std::pow(10.0f, static_cast<float>(i % 4) - 1.0f);  // 0.1 .. 100
      for (size_t j = 0; j < per; ++j) packed[static_cast<size_t>(i) * per + j] *= scale;
    }
    if (c.n_candidates > 1) std::fill_n(packed.begin(), c.dim, 0.0f);  // candidate 0, token 0: all zero
    std::vector<float> norm = random_floats(static_cast<size_t>(c.dim), 0.3f, 41);
    for (auto& v : norm) v += 1.0f;
    std::vector<float> proj = random_floats(static_cast<size_t>(c.dim), c.proj_scale / std::sqrt(static_cast<float>(c.dim)), 42);
    const cuda::DeviceBuffer d_packed = upload_bf16(packed), d_norm = cuda::upload(norm), d_proj = cuda::upload(proj);
    std::vector<const float*> ptrs;
    for (int64_t i = 0; i < c.n_candidates; ++i) ptrs.push_back(packed.data() + static_cast<size_t>(i) * per);
    const ops::AttnResParams p{c.n_candidates, c.n_tokens, c.dim, 1e-5f};
    std::vector<float> ref(per);
    ops::attn_res_mix_cpu(p, ptrs.data(), norm.data(), proj.data(), ref.data());

    cuda::DeviceBuffer out = poisoned(per * 2);
    ops::attn_res_mix_cuda(p, bf16_ptr(d_packed), d_norm.as<float>(), d_proj.as<float>(), bf16_ptr(out), nullptr,
                          kernel);
    sync_device();
    const std::vector<float> got = download_bf16(out, per);
    EXPECT_LE(max_rel_error(got, ref), kTolBf16Out);

    // Over the last candidate: same bits as out of place.
    __nv_bfloat16* last = bf16_ptr(d_packed) + static_cast<size_t>(c.n_candidates - 1) * per;
    ops::attn_res_mix_cuda(p, bf16_ptr(d_packed), d_norm.as<float>(), d_proj.as<float>(), last, nullptr, kernel);
    sync_device();
    const std::vector<float> all = download_bf16(d_packed, total);
    EXPECT_EQ(first_mismatch(std::vector<float>(all.end() - static_cast<std::ptrdiff_t>(per), all.end()), got), -1);

    // Fused with the RMSNorm: h as above, x as rmsnorm_cuda(h) within its rounding (the sum of squares is reduced in
    // another order), and both against the CPU.
    std::vector<float> rms_w = random_floats(static_cast<size_t>(c.dim), 0.2f, 43);
    for (auto& v : rms_w) v += 1.0f;
    const cuda::DeviceBuffer d_rms_w = cuda::upload(rms_w);
    const cuda::DeviceBuffer d_again = upload_bf16(packed);
    cuda::DeviceBuffer h = poisoned(per * 2), x = poisoned(per * 2), x_ref = poisoned(per * 2);
    ops::attn_res_mix_rmsnorm_cuda(p, bf16_ptr(d_again), d_norm.as<float>(), d_proj.as<float>(), d_rms_w.as<float>(),
                                   1e-6f, bf16_ptr(h), bf16_ptr(x), nullptr, kernel);
    ops::rmsnorm_cuda({c.n_tokens, c.dim, 1e-6f}, bf16_ptr(h), d_rms_w.as<float>(), bf16_ptr(x_ref), nullptr);
    sync_device();
    EXPECT_EQ(first_mismatch(download_bf16(h, per), got), -1) << "fused h differs from the mix";
    const std::vector<float> got_x = download_bf16(x, per), want_x = download_bf16(x_ref, per);
    EXPECT_LE(max_rel_error(got_x, want_x), kTolBf16Out);
    std::vector<float> h_host = download_bf16(h, per), x_cpu(per);
    ops::rmsnorm_cpu({c.n_tokens, c.dim, 1e-6f}, h_host.data(), rms_w.data(), x_cpu.data());
    EXPECT_LE(max_rel_error(got_x, x_cpu), kTolBf16Out);
  }
}

// The residual update folded into the mix: the partial sum (last candidate) becomes partial + addend (or the addend)
// in the same kernel, bit for bit add_inplace_cuda / a copy followed by attn_res_mix_rmsnorm_cuda: the updated
// partial, h and x. 16-byte and scalar paths.
TEST(AttnResParity, AddFoldedIntoTheMixEqualsAddThenMix) {
  BG_REQUIRE_GPU();
  const MixCase cases[] = {{9, 1, 7168, 1.0f}, {9, 17, 7168, 1.0f}, {1, 3, 7168, 1.0f}, {4, 9, 7172, 1.0f},
                           {3, 5, 256, 30.0f}, {16, 2, 12288, 1.0f}};
  for (const auto& [c, kernel] : with_kernels(cases)) {
    for (bool replace : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "n " << c.n_candidates << " T " << c.n_tokens << " D " << c.dim
                                        << (replace ? " replace" : " add") << kernel_name(kernel));
      const size_t per = static_cast<size_t>(c.n_tokens * c.dim), total = per * static_cast<size_t>(c.n_candidates);
      std::vector<float> packed = random_floats(total, 1.0f, static_cast<uint64_t>(c.n_candidates * 7 + c.n_tokens));
      std::vector<float> addend = random_floats(per, 0.5f, 44);
      std::vector<float> norm = random_floats(static_cast<size_t>(c.dim), 0.3f, 45), rms_w = norm;
      for (auto& v : norm) v += 1.0f;
      for (auto& v : rms_w) v += 0.5f;
      const std::vector<float> proj =
          random_floats(static_cast<size_t>(c.dim), c.proj_scale / std::sqrt(static_cast<float>(c.dim)), 46);
      const cuda::DeviceBuffer d_norm = cuda::upload(norm), d_proj = cuda::upload(proj), d_w = cuda::upload(rms_w);
      const cuda::DeviceBuffer d_add = upload_bf16(addend);
      cuda::DeviceBuffer fused = upload_bf16(packed), sep = upload_bf16(packed);
      cuda::DeviceBuffer h1 = poisoned(per * 2), x1 = poisoned(per * 2), h2 = poisoned(per * 2), x2 = poisoned(per * 2);
      const ops::AttnResParams p{c.n_candidates, c.n_tokens, c.dim, 1e-5f};
      ops::attn_res_add_mix_rmsnorm_cuda(p, bf16_ptr(d_add), replace, bf16_ptr(fused), d_norm.as<float>(),
                                         d_proj.as<float>(), d_w.as<float>(), 1e-6f, bf16_ptr(h1), bf16_ptr(x1),
                                         nullptr, kernel);
      __nv_bfloat16* partial = bf16_ptr(sep) + static_cast<size_t>(c.n_candidates - 1) * per;
      if (replace) {
        BG_CUDA_CHECK(cudaMemcpy(partial, d_add.data(), per * 2, cudaMemcpyDeviceToDevice));
      } else {
        ops::add_inplace_cuda(static_cast<int64_t>(per), bf16_ptr(d_add), partial, nullptr);
      }
      ops::attn_res_mix_rmsnorm_cuda(p, bf16_ptr(sep), d_norm.as<float>(), d_proj.as<float>(), d_w.as<float>(), 1e-6f,
                                     bf16_ptr(h2), bf16_ptr(x2), nullptr, kernel);
      sync_device();
      EXPECT_EQ(first_mismatch(download_bf16(fused, total), download_bf16(sep, total)), -1) << "the bank";
      EXPECT_EQ(first_mismatch(download_bf16(h1, per), download_bf16(h2, per)), -1) << "h";
      EXPECT_EQ(first_mismatch(download_bf16(x1, per), download_bf16(x2, per)), -1) << "x";
    }
  }
}

// The cluster kernel (the default from 5 candidates, rows of a multiple of 8 up to 16384) against the block kernel:
// within bf16 rounding of each other (they add in other orders); and a token's h and x do not depend on the batch
// around it (its row alone, then in the middle of 37 tokens: the same bits), for K3's row and rows split over 1, 3
// and 8 CTAs.
TEST(AttnResParity, ClusterKernelIsBatchInvariantAndAgreesWithTheBlockKernel) {
  BG_REQUIRE_GPU();
  for (const int64_t dim : {int64_t{7168}, int64_t{8}, int64_t{2056}, int64_t{16384}}) {
    SCOPED_TRACE(::testing::Message() << "D " << dim);
    const int64_t n = 9, batch = 37, pick = 20;
    const size_t per = static_cast<size_t>(batch * dim);
    std::vector<float> packed = random_floats(per * n, 1.0f, static_cast<uint64_t>(dim));
    std::vector<float> alone(static_cast<size_t>(n * dim));
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(packed.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(i) * per + pick * dim), dim,
                  alone.begin() + i * dim);
    }
    std::vector<float> norm = random_floats(static_cast<size_t>(dim), 0.3f, 47), w = norm;
    for (auto& v : norm) v += 1.0f;
    for (auto& v : w) v += 0.5f;
    const std::vector<float> proj = random_floats(static_cast<size_t>(dim), 1.0f / std::sqrt(float(dim)), 48);
    const cuda::DeviceBuffer d_all = upload_bf16(packed), d_alone = upload_bf16(alone), d_norm = cuda::upload(norm),
                             d_proj = cuda::upload(proj), d_w = cuda::upload(w);
    cuda::DeviceBuffer h = poisoned(per * 2), x = poisoned(per * 2), hb = poisoned(per * 2), xb = poisoned(per * 2);
    cuda::DeviceBuffer h1 = poisoned(static_cast<size_t>(dim) * 2), x1 = poisoned(static_cast<size_t>(dim) * 2);
    ops::attn_res_mix_rmsnorm_cuda({n, batch, dim, 1e-5f}, bf16_ptr(d_all), d_norm.as<float>(), d_proj.as<float>(),
                                   d_w.as<float>(), 1e-6f, bf16_ptr(h), bf16_ptr(x), nullptr,
                                   ops::AttnResKernel::kCluster);
    ops::attn_res_mix_rmsnorm_cuda({n, batch, dim, 1e-5f}, bf16_ptr(d_all), d_norm.as<float>(), d_proj.as<float>(),
                                   d_w.as<float>(), 1e-6f, bf16_ptr(hb), bf16_ptr(xb), nullptr,
                                   ops::AttnResKernel::kBlock);
    ops::attn_res_mix_rmsnorm_cuda({n, 1, dim, 1e-5f}, bf16_ptr(d_alone), d_norm.as<float>(), d_proj.as<float>(),
                                   d_w.as<float>(), 1e-6f, bf16_ptr(h1), bf16_ptr(x1), nullptr,
                                   ops::AttnResKernel::kCluster);
    sync_device();
    const std::vector<float> got_h = download_bf16(h, per), got_x = download_bf16(x, per);
    EXPECT_LE(max_rel_error(got_h, download_bf16(hb, per)), kTolBf16Out);
    EXPECT_LE(max_rel_error(got_x, download_bf16(xb, per)), kTolBf16Out);
    const auto row = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + pick * dim, v.begin() + (pick + 1) * dim);
    };
    EXPECT_EQ(first_mismatch(row(got_h), download_bf16(h1, static_cast<size_t>(dim))), -1) << "h";
    EXPECT_EQ(first_mismatch(row(got_x), download_bf16(x1, static_cast<size_t>(dim))), -1) << "x";
  }
}

TEST(AttnResParity, RejectsBadParams) {
  BG_REQUIRE_GPU();
  cuda::DeviceBuffer b(64);
  EXPECT_THROW(ops::attn_res_mix_cuda({0, 1, 4, 1e-5f}, bf16_ptr(b), b.as<float>(), b.as<float>(), bf16_ptr(b),
                                      nullptr),
               Error);
  EXPECT_THROW(ops::attn_res_mix_cuda({17, 1, 4, 1e-5f}, bf16_ptr(b), b.as<float>(), b.as<float>(), bf16_ptr(b),
                                      nullptr),
               Error);
  EXPECT_NO_THROW(ops::attn_res_mix_cuda({2, 0, 4, 1e-5f}, nullptr, nullptr, nullptr, nullptr, nullptr));
  // The addend, the partial sum (the last candidate), h and x must not overlap.
  cuda::DeviceBuffer big(4 * 8 * 2);
  __nv_bfloat16* base = bf16_ptr(big);
  EXPECT_THROW(ops::attn_res_add_mix_rmsnorm_cuda({2, 1, 8, 1e-5f}, base + 8, false, base, b.as<float>(),
                                                  b.as<float>(), b.as<float>(), 1e-6f, base + 16, base + 24, nullptr),
               Error);
  EXPECT_THROW(ops::attn_res_add_mix_rmsnorm_cuda({2, 1, 8, 1e-5f}, base + 16, false, base, b.as<float>(),
                                                  b.as<float>(), b.as<float>(), 1e-6f, base + 16, base + 24, nullptr),
               Error);
  EXPECT_THROW(ops::attn_res_mix_rmsnorm_cuda({2, 1, 4, 1e-5f}, bf16_ptr(b), b.as<float>(), b.as<float>(), b.as<float>(),
                                              1e-6f, bf16_ptr(b), bf16_ptr(b), nullptr),
               Error);  // x == h
  EXPECT_THROW(ops::attn_res_mix_rmsnorm_cuda({2, 1, 4, 1e-5f}, bf16_ptr(b), b.as<float>(), b.as<float>(), b.as<float>(),
                                              0.0f, bf16_ptr(b), bf16_ptr(b) + 4, nullptr),
               Error);  // rms eps 0
}

}  // namespace
}  // namespace bg::testing
