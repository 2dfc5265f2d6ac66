// CUDA elementwise ops against their CPU references on bf16-rounded inputs: residual add, sigmoid gate, SwiGLU and
// SiTU over real widths (7168 hidden, 18432 / 2048 intermediates) and ragged token counts, saturated inputs and the
// allowed aliasing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda/small_ops_testing.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/situ/situ_cuda.h"
#include "ops/swiglu/swiglu_cuda.h"

namespace bg::testing {
namespace {

// Sizes: tokens x width for the real widths, plus a few odd sizes.
std::vector<int64_t> sizes(int64_t width) {
  std::vector<int64_t> out;
  for (int64_t t : {1, 3, 17, 128}) out.push_back(t * width);
  out.push_back(1);
  out.push_back(1000 * 33);
  return out;
}

// Scales cycling over 0.1 .. 300 so that exp / tanh saturate on some elements.
std::vector<float> wide_floats(size_t n, uint64_t seed) {
  std::vector<float> v = random_floats(n, 1.0f, seed);
  for (size_t i = 0; i < n; ++i) v[i] *= std::pow(10.0f, -1.0f + 3.5f * static_cast<float>(i % 13) / 12.0f);
  if (n > 2) {
    v[0] = -1000.0f;
    v[1] = 1000.0f;
  }
  return v;
}

TEST(ElementwiseParity, AddInPlace) {
  BG_REQUIRE_GPU();
  for (int64_t n : sizes(7168)) {
    std::vector<float> x = random_floats(static_cast<size_t>(n), 1.0f, 1), y = random_floats(x.size(), 30.0f, 2);
    const cuda::DeviceBuffer d_x = upload_bf16(x);
    cuda::DeviceBuffer d_y = upload_bf16(y);
    ops::add_inplace_cpu(n, x.data(), y.data());
    ops::add_inplace_cuda(n, bf16_ptr(d_x), bf16_ptr(d_y), nullptr);
    sync_device();
    // One fp32 add of bf16 values then one rounding: exactly the rounded CPU sum.
    EXPECT_EQ(first_mismatch(download_bf16(d_y, x.size()), round_bf16(y)), -1) << "n " << n;
  }
}

TEST(ElementwiseParity, SigmoidGate) {
  BG_REQUIRE_GPU();
  for (int64_t n : sizes(128 * 128)) {
    std::vector<float> g = wide_floats(static_cast<size_t>(n), 3), x = random_floats(g.size(), 2.0f, 4);
    const cuda::DeviceBuffer d_g = upload_bf16(g);
    cuda::DeviceBuffer d_x = upload_bf16(x);
    ops::sigmoid_gate_cpu(n, g.data(), x.data());
    ops::sigmoid_gate_cuda(n, bf16_ptr(d_g), bf16_ptr(d_x), nullptr);
    sync_device();
    EXPECT_LE(max_rel_error(download_bf16(d_x, g.size()), x), kTolBf16Out) << "n " << n;
  }
}

// gate as a strided column view of a [T, I + 40] buffer (a fused group's output read in place): the bits of the
// packed call on a copy of those columns.
TEST(ElementwiseParity, SigmoidGateReadsStridedGate) {
  BG_REQUIRE_GPU();
  for (const int64_t rows : {1, 7, 64}) {
    const int64_t cols = 96 * 64, ld = cols + 40, col = 24;
    const auto n = static_cast<size_t>(rows * cols);
    std::vector<float> all = wide_floats(static_cast<size_t>(rows * ld), 14), g(n);
    for (int64_t t = 0; t < rows; ++t) {
      std::copy_n(all.begin() + t * ld + col, cols, g.begin() + t * cols);
    }
    std::vector<float> x = random_floats(n, 2.0f, 15);
    const cuda::DeviceBuffer d_all = upload_bf16(all), d_g = upload_bf16(g);
    cuda::DeviceBuffer want = upload_bf16(x), got = upload_bf16(x);
    ops::sigmoid_gate_cuda(static_cast<int64_t>(n), bf16_ptr(d_g), bf16_ptr(want), nullptr);
    ops::sigmoid_gate_cuda(rows, cols, bf16_ptr(d_all) + col, ld, bf16_ptr(got), nullptr);
    sync_device();
    EXPECT_EQ(first_mismatch(download_bf16(got, n), download_bf16(want, n)), -1) << "rows " << rows;
  }
  cuda::DeviceBuffer b(64);
  EXPECT_THROW(ops::sigmoid_gate_cuda(1, 8, bf16_ptr(b), 4, bf16_ptr(b), nullptr), Error);
  EXPECT_THROW(ops::sigmoid_gate_cuda(1, 0, bf16_ptr(b), 0, bf16_ptr(b), nullptr), Error);
}

TEST(ElementwiseParity, SwigluOutOfPlaceAndOverGate) {
  BG_REQUIRE_GPU();
  for (int64_t n : sizes(18432)) {
    std::vector<float> g = wide_floats(static_cast<size_t>(n), 5), u = random_floats(g.size(), 1.0f, 6);
    const cuda::DeviceBuffer d_u = upload_bf16(u);
    cuda::DeviceBuffer d_g = upload_bf16(g), out = poisoned(g.size() * 2);
    std::vector<float> ref(g.size());
    ops::swiglu_cpu(g.data(), u.data(), n, ref.data());
    ops::swiglu_cuda(n, bf16_ptr(d_g), bf16_ptr(d_u), bf16_ptr(out), nullptr);
    sync_device();
    const std::vector<float> got = download_bf16(out, g.size());
    EXPECT_LE(max_rel_error(got, ref), kTolBf16Out) << "n " << n;
    ops::swiglu_cuda(n, bf16_ptr(d_g), bf16_ptr(d_u), bf16_ptr(d_g), nullptr);  // out over gate
    sync_device();
    EXPECT_EQ(first_mismatch(download_bf16(d_g, g.size()), got), -1) << "n " << n;
  }
}

TEST(ElementwiseParity, SituOutOfPlaceAndOverUp) {
  BG_REQUIRE_GPU();
  for (int64_t n_inter : {2048, 18432, 7}) {
    for (int64_t n_tokens : {1, 3, 17, 128}) {
      const ops::SituParams p{n_tokens, n_inter, 4.0f, 25.0f};
      const size_t n = static_cast<size_t>(n_tokens * n_inter);
      std::vector<float> g = wide_floats(n, 7), u = wide_floats(n, 8);
      const cuda::DeviceBuffer d_g = upload_bf16(g);
      cuda::DeviceBuffer d_u = upload_bf16(u), out = poisoned(n * 2);
      std::vector<float> ref(n);
      ops::situ_cpu(p, g.data(), u.data(), ref.data());
      ops::situ_cuda(p, bf16_ptr(d_g), bf16_ptr(d_u), bf16_ptr(out), nullptr);
      sync_device();
      const std::vector<float> got = download_bf16(out, n);
      EXPECT_LE(max_rel_error(got, ref), kTolBf16Out) << "T " << n_tokens << " I " << n_inter;
      ops::situ_cuda(p, bf16_ptr(d_g), bf16_ptr(d_u), bf16_ptr(d_u), nullptr);  // out over up
      sync_device();
      EXPECT_EQ(first_mismatch(download_bf16(d_u, n), got), -1) << "T " << n_tokens << " I " << n_inter;
    }
  }
  // Other betas.
  const ops::SituParams p{3, 64, 2.0f, 10.0f};
  std::vector<float> g = wide_floats(192, 9), u = wide_floats(192, 10);
  const cuda::DeviceBuffer d_g = upload_bf16(g), d_u = upload_bf16(u);
  cuda::DeviceBuffer out = poisoned(192 * 2);
  std::vector<float> ref(192);
  ops::situ_cpu(p, g.data(), u.data(), ref.data());
  ops::situ_cuda(p, bf16_ptr(d_g), bf16_ptr(d_u), bf16_ptr(out), nullptr);
  sync_device();
  EXPECT_LE(max_rel_error(download_bf16(out, 192), ref), kTolBf16Out);
}

// gate and up as strided column views of one [T, 2I + 24] buffer (a fused group's output read in place): the same
// bits as from packed copies of them.
TEST(ElementwiseParity, SituReadsStridedGateAndUp) {
  BG_REQUIRE_GPU();
  for (const int64_t n_tokens : {1, 5, 64}) {
    const int64_t inter = 96, ld = 2 * inter + 24;
    const ops::SituParams p{n_tokens, inter, 4.0f, 25.0f};
    const auto n = static_cast<size_t>(n_tokens * inter);
    std::vector<float> all = wide_floats(static_cast<size_t>(n_tokens * ld), 11), g(n), u(n);
    for (int64_t t = 0; t < n_tokens; ++t) {
      for (int64_t c = 0; c < inter; ++c) {
        g[static_cast<size_t>(t * inter + c)] = all[static_cast<size_t>(t * ld + 8 + c)];
        u[static_cast<size_t>(t * inter + c)] = all[static_cast<size_t>(t * ld + 8 + inter + c)];
      }
    }
    const cuda::DeviceBuffer d_all = upload_bf16(all), d_g = upload_bf16(g), d_u = upload_bf16(u);
    cuda::DeviceBuffer want = poisoned(n * 2), got = poisoned(n * 2);
    ops::situ_cuda(p, bf16_ptr(d_g), bf16_ptr(d_u), bf16_ptr(want), nullptr);
    ops::situ_cuda(p, bf16_ptr(d_all) + 8, bf16_ptr(d_all) + 8 + inter, bf16_ptr(got), nullptr, ld, ld);
    sync_device();
    EXPECT_EQ(first_mismatch(download_bf16(got, n), download_bf16(want, n)), -1) << "T " << n_tokens;
  }
  cuda::DeviceBuffer b(64);
  EXPECT_THROW(ops::situ_cuda({1, 8, 4.0f, 25.0f}, bf16_ptr(b), bf16_ptr(b), bf16_ptr(b), nullptr, 4, 8), Error);
}

// The two kernels give the same bits: 16-byte rows from 64 rows on (the eight-wide kernel, rows past the grid's 65535
// strided over) against the same values one element off 16-byte alignment (the grid-stride kernel), and the CPU
// reference.
TEST(ElementwiseParity, SituEightWideMatchesScalarKernel) {
  BG_REQUIRE_GPU();
  for (const int64_t n_tokens : {int64_t{64}, int64_t{70000}}) {
    const int64_t inter = 16;
    const ops::SituParams p{n_tokens, inter, 4.0f, 25.0f};
    const auto n = static_cast<size_t>(n_tokens * inter);
    std::vector<float> g = wide_floats(n, 12), u = wide_floats(n, 13);
    std::vector<float> g_off(n + 1, 0.0f), u_off(n + 1, 0.0f);
    std::copy(g.begin(), g.end(), g_off.begin() + 1);
    std::copy(u.begin(), u.end(), u_off.begin() + 1);
    const cuda::DeviceBuffer d_g = upload_bf16(g), d_u = upload_bf16(u), d_g_off = upload_bf16(g_off),
                             d_u_off = upload_bf16(u_off);
    cuda::DeviceBuffer wide = poisoned(n * 2), scalar = poisoned((n + 1) * 2);
    ops::situ_cuda(p, bf16_ptr(d_g), bf16_ptr(d_u), bf16_ptr(wide), nullptr);
    ops::situ_cuda(p, bf16_ptr(d_g_off) + 1, bf16_ptr(d_u_off) + 1, bf16_ptr(scalar) + 1, nullptr);
    sync_device();
    const std::vector<float> got = download_bf16(wide, n), scalar_all = download_bf16(scalar, n + 1);
    EXPECT_EQ(first_mismatch(got, std::vector<float>(scalar_all.begin() + 1, scalar_all.end())), -1)
        << "T " << n_tokens;
    std::vector<float> ref(n);
    ops::situ_cpu(p, g.data(), u.data(), ref.data());
    EXPECT_LE(max_rel_error(got, ref), kTolBf16Out) << "T " << n_tokens;
  }
}

TEST(ElementwiseParity, RejectsBadParams) {
  BG_REQUIRE_GPU();
  cuda::DeviceBuffer b(64);
  EXPECT_THROW(ops::add_inplace_cuda(-1, bf16_ptr(b), bf16_ptr(b), nullptr), Error);
  EXPECT_THROW(ops::swiglu_cuda(4, nullptr, bf16_ptr(b), bf16_ptr(b), nullptr), Error);
  EXPECT_THROW(ops::situ_cuda({1, 4, 0.0f, 25.0f}, bf16_ptr(b), bf16_ptr(b), bf16_ptr(b), nullptr), Error);
  EXPECT_NO_THROW(ops::sigmoid_gate_cuda(0, nullptr, nullptr, nullptr));
}

}  // namespace
}  // namespace bg::testing
