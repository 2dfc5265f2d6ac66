// The dense decode GEMM (ops/linear/linear_decode_cuda.cu) against linear_cpu: every tile shape (1, 2, 4, 8 n8 blocks;
// one and two m16 tiles per warp), ragged row tiles and token counts, one split and several (each shape's plan says
// which), fp32 and bf16 outputs, y += x W^T; the same bits on every run (split sums added in split order, counters
// reset by their last arrival); what kAuto hands to cuBLAS instead; and the refusals.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "ops/linear/linear.h"
#include "ops/linear/linear_cuda.h"
#include "ops/linear/linear_decode_plan.h"

namespace bg::ops {
namespace {

using testing::CublasFixture;
using testing::HostWeight;

struct DecodeFixture {
  CublasFixture cub;
  cuda::DeviceBuffer buffer{dense_decode_workspace_bytes()};
  DenseDecodeWorkspace ws = dense_decode_workspace(buffer.data());
  DecodeFixture() {
    dense_decode_workspace_init(ws, nullptr);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
  }
  LinearCudaContext ctx() const { return {cub.handle, cub.workspace.data(), cub.workspace.bytes(), nullptr, 0, &ws}; }
};

int sms() {
  int dev = 0, n = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// y (fp32 view) after x W^T on the device, y starting from y0 (bf16 bits or fp32 values per `out`).
std::vector<float> run(DecodeFixture& f, const DeviceWeight& w, const std::vector<uint16_t>& x_bits, int64_t n,
                       LinearOutType out, LinearPath path, bool accumulate, const std::vector<float>& y0) {
  cuda::DeviceBuffer dx = cuda::upload(x_bits);
  const size_t count = static_cast<size_t>(n * w.n_out);
  std::vector<float> start = y0;
  cuda::DeviceBuffer dy = out == LinearOutType::kF32 ? cuda::upload(start) : cuda::upload(testing::to_bf16(start));
  LinearCudaParams p{n, out, path};
  p.accumulate = accumulate;
  linear_cuda(p, w, dx.as<__nv_bfloat16>(), dy.data(), f.ctx(), nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  if (out == LinearOutType::kF32) return cuda::download<float>(dy, count);
  return testing::from_bf16(cuda::download<uint16_t>(dy, count));
}

struct Case {
  int64_t n_out, n_in;
  std::vector<int64_t> tokens;
  LinearOutType out = LinearOutType::kBf16;
  bool accumulate = false;
};

void check(DecodeFixture& f, const Case& c, uint64_t seed) {
  const HostWeight hw =
      testing::random_weight(WeightFormat::kDense, c.n_out, c.n_in, 1.0f / std::sqrt(static_cast<float>(c.n_in)), seed);
  const DeviceWeightStorage dw = upload_weight(hw.w);
  for (int64_t n : c.tokens) {
    const DenseDecodePlan plan = dense_decode_plan(c.n_out, c.n_in, n, sms(), f.ws.partial_bytes, f.ws.n_counters);
    const std::string what = fmt::format("[{} x {}] n={} {} {} (nb {}, m_tiles {}, splits {})", c.n_out, c.n_in, n,
                                         c.out == LinearOutType::kF32 ? "f32" : "bf16",
                                         c.accumulate ? "accumulate" : "write", plan.nb, plan.m_tiles, plan.splits);
    std::vector<float> x, y0;
    const std::vector<uint16_t> x_bits =
        testing::random_bf16(static_cast<size_t>(n * c.n_in), 1.0f, seed * 131 + static_cast<uint64_t>(n), &x);
    const std::vector<uint16_t> y_bits =
        testing::random_bf16(static_cast<size_t>(n * c.n_out), 2.0f, seed * 7 + static_cast<uint64_t>(n), &y0);
    std::vector<float> ref(static_cast<size_t>(n * c.n_out));
    linear_cpu(hw.w, x.data(), n, ref.data());
    if (c.accumulate) {
      for (size_t i = 0; i < ref.size(); ++i) ref[i] += y0[i];
    }
    const std::vector<float> got = run(f, dw.desc, x_bits, n, c.out, LinearPath::kDenseDecode, c.accumulate, y0);
    testing::expect_parity(got, ref, c.out == LinearOutType::kF32 ? 1e-4 : testing::kTolBf16Out, what);
    // Run to run: the same bits (the split sums in split order; the counters were reset by the run before).
    const std::vector<float> again = run(f, dw.desc, x_bits, n, c.out, LinearPath::kDenseDecode, c.accumulate, y0);
    EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * sizeof(float)), 0) << what << ": second run differs";
    // kAuto takes the same kernel here.
    const std::vector<float> aut = run(f, dw.desc, x_bits, n, c.out, LinearPath::kAuto, c.accumulate, y0);
    EXPECT_EQ(std::memcmp(got.data(), aut.data(), got.size() * sizeof(float)), 0) << what << ": kAuto differs";
  }
}

TEST(DenseDecodeParity, TileShapesAndRaggedEdges) {
  BG_REQUIRE_GPU();
  DecodeFixture f;
  check(f, {128, 64, {1, 2}}, 1);                           // one tile, one stage
  check(f, {200, 128, {1, 5, 8, 9, 16}}, 2);                // a partial row tile; 1 and 2 n8 blocks
  check(f, {1000, 640, {17, 31, 32}}, 3);                   // 4 n8 blocks
  check(f, {520, 1024, {33, 47, 64}}, 4);                   // 8 n8 blocks, two m16 tiles per warp, partial tiles
  check(f, {20000, 256, {1, 64}, LinearOutType::kF32}, 5);  // more row tiles than the GPU's slots: one split
}

TEST(DenseDecodeParity, KSplitsAtModelShapes) {
  BG_REQUIRE_GPU();
  DecodeFixture f;
  // Kimi-K3 router 7168 -> 896 (fp32 logits), o_proj 12288 -> 7168, MLA q_b 1536 -> 18432 (one split), a
  // latent-up-like 3584 -> 7168 accumulating into y, a narrow 4096 -> 300 (the most splits).
  check(f, {896, 7168, {1, 3, 16, 64}, LinearOutType::kF32}, 10);
  check(f, {7168, 12288, {1, 20, 64}}, 11);
  check(f, {18432, 1536, {16, 64}}, 12);
  check(f, {7168, 3584, {1, 16, 64}, LinearOutType::kBf16, true}, 13);
  check(f, {7168, 3584, {7}, LinearOutType::kF32, true}, 14);
  check(f, {300, 4096, {1, 16, 64}}, 15);
}

// A fused group's outputs written part by part (dense_decode_parts_cuda): each part equals its columns of the whole
// product, bit for bit, at every tile shape; parts that do not tile the columns are refused.
TEST(DenseDecodeParity, ColumnPartsEqualTheWholeProduct) {
  BG_REQUIRE_GPU();
  DecodeFixture f;
  const std::vector<int64_t> cols = {100, 28, 1000, 8};
  const int64_t n_out = 1136, n_in = 1280;
  const HostWeight hw = testing::random_weight(WeightFormat::kDense, n_out, n_in, 0.03f, 30);
  const DeviceWeightStorage dw = upload_weight(hw.w);
  for (int64_t n : {1, 7, 24, 40, 64}) {
    std::vector<float> x;
    const std::vector<uint16_t> x_bits = testing::random_bf16(static_cast<size_t>(n * n_in), 1.0f, 31 + n, &x);
    const std::vector<float> whole = run(f, dw.desc, x_bits, n, LinearOutType::kBf16, LinearPath::kDenseDecode, false,
                                         std::vector<float>(static_cast<size_t>(n * n_out), 0.0f));
    cuda::DeviceBuffer dx = cuda::upload(x_bits);
    std::vector<cuda::DeviceBuffer> outs;
    std::vector<ColumnSlice> parts;
    int64_t col = 0;
    for (int64_t c : cols) {
      outs.emplace_back(static_cast<size_t>(n * c) * 2);
      outs.back().fill_bytes(0xff);
      parts.push_back({col, c, outs.back().data()});
      col += c;
    }
    dense_decode_parts_cuda({n, LinearOutType::kBf16}, dw.desc, dx.as<__nv_bfloat16>(), parts, f.ws, nullptr);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    int64_t differ = 0;
    for (size_t i = 0; i < cols.size(); ++i) {
      const std::vector<float> got =
          testing::from_bf16(cuda::download<uint16_t>(outs[i], static_cast<size_t>(n * cols[i])));
      for (int64_t t = 0; t < n; ++t)
        for (int64_t c = 0; c < cols[i]; ++c) {
          const float a = got[static_cast<size_t>(t * cols[i] + c)];
          const float b = whole[static_cast<size_t>(t * n_out + parts[i].col0 + c)];
          differ += std::memcmp(&a, &b, sizeof a) != 0;
        }
    }
    EXPECT_EQ(differ, 0) << "n=" << n;
    std::vector<ColumnSlice> gap = parts;
    gap[1].col0 += 1;
    EXPECT_THROW(
        dense_decode_parts_cuda({n, LinearOutType::kBf16}, dw.desc, dx.as<__nv_bfloat16>(), gap, f.ws, nullptr), Error);
    gap = parts;
    gap.pop_back();
    EXPECT_THROW(
        dense_decode_parts_cuda({n, LinearOutType::kBf16}, dw.desc, dx.as<__nv_bfloat16>(), gap, f.ws, nullptr), Error);
  }
}

// What the decode GEMM does not take: kAuto hands it to cuBLAS (n_in % 64, more tokens, no workspace); an explicit
// request is refused, and so are the dense paths for a quantized weight.
TEST(DenseDecodeParity, FallbacksAndRefusals) {
  BG_REQUIRE_GPU();
  DecodeFixture f;
  const HostWeight hw = testing::random_weight(WeightFormat::kDense, 256, 96, 0.1f, 20);
  const DeviceWeightStorage dw = upload_weight(hw.w);
  std::vector<float> x;
  const std::vector<uint16_t> x_bits = testing::random_bf16(4 * 96, 1.0f, 21, &x);
  const std::vector<float> y0(4 * 256, 0.0f);
  std::vector<float> ref(4 * 256);
  linear_cpu(hw.w, x.data(), 4, ref.data());
  testing::expect_parity(run(f, dw.desc, x_bits, 4, LinearOutType::kF32, LinearPath::kAuto, false, y0), ref, 1e-4,
                         "n_in 96 through kAuto (cuBLAS)");
  EXPECT_FALSE(dense_decode_applies({4, LinearOutType::kF32}, dw.desc, nullptr, f.ctx()));
  EXPECT_THROW(run(f, dw.desc, x_bits, 4, LinearOutType::kF32, LinearPath::kDenseDecode, false, y0), Error);

  const HostWeight h64 = testing::random_weight(WeightFormat::kDense, 256, 128, 0.1f, 22);
  const DeviceWeightStorage d64 = upload_weight(h64.w);
  cuda::DeviceBuffer dx(static_cast<size_t>(100 * 128) * 2), dy(static_cast<size_t>(100 * 256) * 4);
  const auto* xp = dx.as<__nv_bfloat16>();
  const LinearCudaContext with = f.ctx();
  LinearCudaContext without = with;
  without.dense_decode = nullptr;
  EXPECT_TRUE(dense_decode_applies({64, LinearOutType::kF32}, d64.desc, xp, with));
  EXPECT_FALSE(dense_decode_applies({65, LinearOutType::kF32}, d64.desc, xp, with));
  EXPECT_FALSE(dense_decode_applies({64, LinearOutType::kF32}, d64.desc, xp, without));
  EXPECT_FALSE(dense_decode_applies({64, LinearOutType::kF32, LinearPath::kAuto, true}, d64.desc, xp, with));
  EXPECT_FALSE(dense_decode_applies({64, LinearOutType::kF32}, d64.desc, xp + 1, with));  // x not 16-byte aligned
  EXPECT_THROW(linear_cuda({65, LinearOutType::kF32, LinearPath::kDenseDecode}, d64.desc, xp, dy.data(), with, nullptr),
               Error);
  EXPECT_THROW(
      linear_cuda({8, LinearOutType::kF32, LinearPath::kDenseDecode}, d64.desc, xp, dy.data(), without, nullptr),
      Error);
  EXPECT_THROW(
      linear_cuda({8, LinearOutType::kF32, LinearPath::kDenseDecode, true}, d64.desc, xp, dy.data(), with, nullptr),
      Error);
  DeviceWeight q{WeightFormat::kMxfp4, 64, 64, dx.data(), dx.data()};
  EXPECT_THROW(linear_cuda({1, LinearOutType::kF32, LinearPath::kCublas}, q, xp, dy.data(), with, nullptr), Error);
  EXPECT_THROW(linear_cuda({1, LinearOutType::kF32, LinearPath::kDenseDecode}, q, xp, dy.data(), with, nullptr), Error);
}

}  // namespace
}  // namespace bg::ops
