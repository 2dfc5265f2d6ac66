// linear_cuda against linear_cpu on the same bf16 inputs and the same stored weights (dense bf16, FP8 block, MXFP4),
// over real DeepSeek-V3 / Kimi-K3 shapes, ragged FP8 edges, token counts 0..1000, both quantized paths, and the
// boundary checks. Tolerances (relative to max |ref|): bf16 outputs 1e-2; fp32 outputs 1e-4 (fp32 logits of bf16
// inputs: the only difference is the fp32 summation order over up to 7168 products), except FP8 on the dequant path
// whose weights are rounded to bf16 before cuBLAS (1e-2).
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

namespace bg::ops {
namespace {

using testing::CublasFixture;
using testing::HostWeight;

struct LinearCase {
  WeightFormat format;
  int64_t n_out, n_in;
  std::vector<int64_t> token_counts;
  LinearOutType out = LinearOutType::kBf16;
  LinearPath path = LinearPath::kAuto;
  bool min_scratch = false;  // dequant path: the smallest scratch (128 rows per chunk) instead of the suggested one
};

std::string describe(const LinearCase& c, int64_t n) {
  return fmt::format("{} [{} x {}] n={} out={} path={}", weight_format_name(c.format), c.n_out, c.n_in, n,
                     c.out == LinearOutType::kF32 ? "f32" : "bf16", static_cast<int>(c.path));
}

double tolerance(const LinearCase& c, int64_t n) {
  if (c.out == LinearOutType::kBf16) return testing::kTolBf16Out;
  const bool dequant = c.format != WeightFormat::kDense &&
                       (c.path == LinearPath::kDequantGemm ||
                        (c.path == LinearPath::kAuto && n > kLinearSkinnyMaxTokens));
  return c.format == WeightFormat::kFp8Block && dequant ? testing::kTolBf16Out : 1e-4;
}

// Runs y = x W^T on the device for x [n, in] (bf16 bits) and returns y as fp32 (poisoned with NaN before the launch).
std::vector<float> run_device(const LinearCase& c, const DeviceWeight& w, const std::vector<uint16_t>& x_bits,
                              int64_t n, CublasFixture& cub) {
  const LinearCudaParams p{n, c.out, c.path};
  cuda::DeviceBuffer dx = cuda::upload(x_bits);
  const size_t out_elem = c.out == LinearOutType::kF32 ? 4 : 2;
  cuda::DeviceBuffer dy(static_cast<size_t>(n * c.n_out) * out_elem);
  dy.fill_bytes(0xff);
  const size_t scratch_bytes =
      c.min_scratch ? linear_dequant_scratch_min_bytes(w) : linear_dequant_scratch_bytes(w, p);
  cuda::DeviceBuffer scratch(scratch_bytes);
  const LinearCudaContext ctx{cub.handle, cub.workspace.data(), cub.workspace.bytes(), scratch.data(),
                              scratch.bytes()};
  linear_cuda(p, w, dx.as<__nv_bfloat16>(), dy.data(), ctx, nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  if (c.out == LinearOutType::kF32) return cuda::download<float>(dy, static_cast<size_t>(n * c.n_out));
  return testing::from_bf16(cuda::download<uint16_t>(dy, static_cast<size_t>(n * c.n_out)));
}

void run_case(const LinearCase& c, uint64_t seed) {
  CublasFixture cub;
  const HostWeight hw =
      testing::random_weight(c.format, c.n_out, c.n_in, 1.0f / std::sqrt(static_cast<float>(c.n_in)), seed);
  const DeviceWeightStorage dw = upload_weight(hw.w);
  for (int64_t n : c.token_counts) {
    std::vector<float> x;
    const std::vector<uint16_t> x_bits =
        testing::random_bf16(static_cast<size_t>(n * c.n_in), 1.0f, seed * 31 + static_cast<uint64_t>(n), &x);
    const std::vector<float> got = run_device(c, dw.desc, x_bits, n, cub);
    std::vector<float> ref(static_cast<size_t>(n * c.n_out));
    linear_cpu(hw.w, x.data(), n, ref.data());
    testing::expect_parity(got, ref, tolerance(c, n), describe(c, n));
  }
}

TEST(LinearCudaParity, DenseRouterLogitsF32) {
  BG_REQUIRE_GPU();
  // DeepSeek-V3 / Kimi router gate 7168 -> 896 (Kimi-K3 expert count), fp32 logits.
  run_case({WeightFormat::kDense, 896, 7168, {0, 1, 3, 16, 100}, LinearOutType::kF32}, 1);
}

TEST(LinearCudaParity, DenseBf16Out) {
  BG_REQUIRE_GPU();
  run_case({WeightFormat::kDense, 2048, 7168, {1, 1000}}, 2);
  run_case({WeightFormat::kDense, 130, 200, {3, 17}}, 3);  // odd shapes through cuBLAS
}

TEST(LinearCudaParity, DenseLmHeadOneToken) {
  BG_REQUIRE_GPU();
  run_case({WeightFormat::kDense, 163840, 7168, {1}, LinearOutType::kF32}, 4);
}

TEST(LinearCudaParity, DenseF32UploadRoundsToBf16) {
  BG_REQUIRE_GPU();
  CublasFixture cub;
  const HostWeight w32 = testing::random_weight(WeightFormat::kDense, 300, 256, 0.1f, 5, /*dense_f32=*/true);
  // The reference sees the weights rounded to bf16, exactly as the upload stores them.
  HostWeight w16 = testing::random_weight(WeightFormat::kDense, 300, 256, 0.1f, 5);
  const std::vector<float> f = w32.w.data.to_f32();
  auto* bits = reinterpret_cast<uint16_t*>(w16.data.data());
  for (size_t i = 0; i < f.size(); ++i) bits[i] = f32_to_bf16(f[i]);
  const DeviceWeightStorage dw = upload_weight(w32.w);
  const LinearCase c{WeightFormat::kDense, 300, 256, {5}, LinearOutType::kF32};
  std::vector<float> x;
  const std::vector<uint16_t> x_bits = testing::random_bf16(5 * 256, 1.0f, 6, &x);
  const std::vector<float> got = run_device(c, dw.desc, x_bits, 5, cub);
  std::vector<float> ref(5 * 300);
  linear_cpu(w16.w, x.data(), 5, ref.data());
  testing::expect_parity(got, ref, 1e-4, "dense F32 upload [300 x 256] n=5");
}

TEST(LinearCudaParity, Fp8RaggedEdges) {
  BG_REQUIRE_GPU();
  // 130 x 200: the last 128-block is 2 rows by 72 columns.
  run_case({WeightFormat::kFp8Block, 130, 200, {0, 1, 3, 16, 100}}, 10);
  run_case({WeightFormat::kFp8Block, 130, 200, {100}, LinearOutType::kF32, LinearPath::kSkinny}, 11);
  run_case({WeightFormat::kFp8Block, 130, 200, {1, 3}, LinearOutType::kBf16, LinearPath::kDequantGemm, true}, 12);
  run_case({WeightFormat::kFp8Block, 130, 204, {2}, LinearOutType::kF32}, 13);  // n_in % 8 != 0: scalar loads
}

TEST(LinearCudaParity, Fp8RealShapes) {
  BG_REQUIRE_GPU();
  run_case({WeightFormat::kFp8Block, 2048, 7168, {1, 16, 100}}, 20);
  run_case({WeightFormat::kFp8Block, 7168, 2048, {3, 1000}}, 21);
  run_case({WeightFormat::kFp8Block, 18432, 7168, {1}, LinearOutType::kF32}, 22);
  run_case({WeightFormat::kFp8Block, 18432, 7168, {100}}, 23);  // dequant in 5 chunks of 4096 rows
}

TEST(LinearCudaParity, Mxfp4RealShapes) {
  BG_REQUIRE_GPU();
  run_case({WeightFormat::kMxfp4, 2048, 7168, {1, 3, 16, 100}}, 30);
  run_case({WeightFormat::kMxfp4, 7168, 2048, {1, 1000}}, 31);
  run_case({WeightFormat::kMxfp4, 3072, 3584, {16, 100}, LinearOutType::kF32}, 32);
  run_case({WeightFormat::kMxfp4, 3584, 3072, {1, 3}}, 33);
}

TEST(LinearCudaParity, Mxfp4ForcedPaths) {
  BG_REQUIRE_GPU();
  run_case({WeightFormat::kMxfp4, 3072, 3584, {100}, LinearOutType::kF32, LinearPath::kSkinny}, 40);
  run_case({WeightFormat::kMxfp4, 3584, 3072, {3}, LinearOutType::kF32, LinearPath::kDequantGemm, true}, 41);
  run_case({WeightFormat::kMxfp4, 100, 96, {1, 7, 40}, LinearOutType::kF32}, 42);  // fewer rows than one block
}

// accumulate: y += x W^T in one GEMM (cuBLAS beta = 1) at the K3 latent-up shape, against the CPU product plus y's
// starting values; refused for quantized weights and with deterministic.
TEST(LinearCudaParity, DenseAccumulateAddsToY) {
  BG_REQUIRE_GPU();
  CublasFixture cub;
  const int64_t n_out = 7168, n_in = 3584;
  const HostWeight hw = testing::random_weight(WeightFormat::kDense, n_out, n_in, 1.0f / std::sqrt(3584.0f), 7);
  const DeviceWeightStorage dw = upload_weight(hw.w);
  for (int64_t n : {1, 16, 64, 300}) {
    std::vector<float> x, y0;
    const std::vector<uint16_t> x_bits = testing::random_bf16(static_cast<size_t>(n * n_in), 1.0f, 8 + n, &x);
    const std::vector<uint16_t> y_bits = testing::random_bf16(static_cast<size_t>(n * n_out), 2.0f, 9 + n, &y0);
    cuda::DeviceBuffer dx = cuda::upload(x_bits), dy = cuda::upload(y_bits);
    const LinearCudaContext ctx{cub.handle, cub.workspace.data(), cub.workspace.bytes(), nullptr, 0};
    LinearCudaParams p{n, LinearOutType::kBf16, LinearPath::kAuto};
    p.accumulate = true;
    linear_cuda(p, dw.desc, dx.as<__nv_bfloat16>(), dy.data(), ctx, nullptr);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ref(static_cast<size_t>(n * n_out));
    linear_cpu(hw.w, x.data(), n, ref.data());
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += y0[i];
    testing::expect_parity(testing::from_bf16(cuda::download<uint16_t>(dy, ref.size())), ref, testing::kTolBf16Out,
                           fmt::format("dense accumulate [{} x {}] n={}", n_out, n_in, n));
  }
  const LinearCudaContext ctx{cub.handle, cub.workspace.data(), cub.workspace.bytes(), nullptr, 0};
  LinearCudaParams det{1, LinearOutType::kBf16, LinearPath::kAuto, true};
  det.accumulate = true;
  const auto* x = static_cast<const __nv_bfloat16*>(cub.workspace.data());
  EXPECT_THROW(linear_cuda(det, dw.desc, x, cub.workspace.data(), ctx, nullptr), Error);
  DeviceWeight q{WeightFormat::kMxfp4, 64, 64, cub.workspace.data(), cub.workspace.data()};
  LinearCudaParams pq{1, LinearOutType::kBf16, LinearPath::kSkinny};
  pq.accumulate = true;
  EXPECT_THROW(linear_cuda(pq, q, x, cub.workspace.data(), ctx, nullptr), Error);
}

// x as a strided column view of a wider buffer (LinearCudaParams::x_ld: Kimi-K3's f_a part of the fused KDA group
// feeding f_b, read in place): the dense cuBLAS path takes its row stride as lda; the paths that need packed rows
// (deterministic tiles, quantized weights) refuse it.
TEST(LinearCudaParity, DenseStridedInputRows) {
  BG_REQUIRE_GPU();
  CublasFixture cub;
  const int64_t n_out = 1536, n_in = 128, ld = 49376, col0 = 49152;
  const HostWeight hw = testing::random_weight(WeightFormat::kDense, n_out, n_in, 1.0f / std::sqrt(128.0f), 17);
  const DeviceWeightStorage dw = upload_weight(hw.w);
  const LinearCudaContext ctx{cub.handle, cub.workspace.data(), cub.workspace.bytes(), nullptr, 0};
  for (int64_t n : {2, 17, 64}) {
    std::vector<float> wide_f;
    const std::vector<uint16_t> wide = testing::random_bf16(static_cast<size_t>(n * ld), 1.0f, 18 + n, &wide_f);
    std::vector<float> x(static_cast<size_t>(n * n_in));
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(wide_f.begin() + t * ld + col0, n_in, x.begin() + t * n_in);
    }
    const cuda::DeviceBuffer dx = cuda::upload(wide);
    cuda::DeviceBuffer dy(static_cast<size_t>(n * n_out) * 2);
    dy.fill_bytes(0xff);
    LinearCudaParams p{n, LinearOutType::kBf16, LinearPath::kAuto};
    p.x_ld = ld;
    linear_cuda(p, dw.desc, dx.as<__nv_bfloat16>() + col0, dy.data(), ctx, nullptr);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ref(static_cast<size_t>(n * n_out));
    linear_cpu(hw.w, x.data(), n, ref.data());
    testing::expect_parity(testing::from_bf16(cuda::download<uint16_t>(dy, ref.size())), ref, testing::kTolBf16Out,
                           fmt::format("strided x, n={}", n));
  }
  const auto* x = static_cast<const __nv_bfloat16*>(cub.workspace.data());
  LinearCudaParams det{2, LinearOutType::kBf16, LinearPath::kAuto, true};
  det.x_ld = ld;
  EXPECT_THROW(linear_cuda(det, dw.desc, x, cub.workspace.data(), ctx, nullptr), Error);
  LinearCudaParams narrow{2, LinearOutType::kBf16, LinearPath::kAuto};
  narrow.x_ld = n_in - 8;  // rows overlap
  EXPECT_THROW(linear_cuda(narrow, dw.desc, x, cub.workspace.data(), ctx, nullptr), Error);
  DeviceWeight q{WeightFormat::kMxfp4, 64, 64, cub.workspace.data(), cub.workspace.data()};
  LinearCudaParams pq{2, LinearOutType::kBf16, LinearPath::kSkinny};
  pq.x_ld = 128;
  EXPECT_THROW(linear_cuda(pq, q, x, cub.workspace.data(), ctx, nullptr), Error);
}

TEST(LinearCudaParity, RejectsBadArguments) {
  BG_REQUIRE_GPU();
  CublasFixture cub;
  const LinearCudaContext ctx{cub.handle, cub.workspace.data(), cub.workspace.bytes(), nullptr, 0};
  DeviceWeight w{WeightFormat::kMxfp4, 64, 48, cub.workspace.data(), cub.workspace.data()};
  const auto* x = static_cast<const __nv_bfloat16*>(cub.workspace.data());
  void* y = cub.workspace.data();
  EXPECT_THROW(linear_cuda({1, LinearOutType::kF32, LinearPath::kAuto}, w, x, y, ctx, nullptr), Error);  // in % 32
  w.n_in = 64;
  // The dequant path without a scratch buffer is an error, not a silent switch to the skinny kernel.
  EXPECT_THROW(linear_cuda({32, LinearOutType::kF32, LinearPath::kAuto}, w, x, y, ctx, nullptr), Error);
  w.format = WeightFormat::kDense;
  EXPECT_THROW(linear_cuda({1, LinearOutType::kF32, LinearPath::kSkinny}, w, x, y, ctx, nullptr), Error);
  w.scale = nullptr;
  w.format = WeightFormat::kFp8Block;
  EXPECT_THROW(linear_cuda({1, LinearOutType::kF32, LinearPath::kAuto}, w, x, y, ctx, nullptr), Error);
}

}  // namespace
// --deterministic: a token's output row is the same bits whatever the token count of the call (dense: every GEMM on
// kLinearFixedTokens rows; FP8/MXFP4: the skinny kernel), at K3's dense shapes; and it still matches the CPU.
TEST(LinearCudaDeterministic, RowsDoNotDependOnTheTokenCount) {
  BG_REQUIRE_GPU();
  CublasFixture cub;
  struct Shape {
    WeightFormat format;
    int64_t n_out, n_in;
    LinearOutType out;
  };
  for (const Shape& sh : {Shape{WeightFormat::kDense, 7168, 7168, LinearOutType::kBf16},
                          Shape{WeightFormat::kDense, 896, 7168, LinearOutType::kF32},
                          Shape{WeightFormat::kDense, 2048, 1536, LinearOutType::kBf16},
                          Shape{WeightFormat::kFp8Block, 3072, 7168, LinearOutType::kBf16}}) {
    const HostWeight hw =
        testing::random_weight(sh.format, sh.n_out, sh.n_in, 1.0f / std::sqrt(static_cast<float>(sh.n_in)), 7);
    const DeviceWeightStorage dw = upload_weight(hw.w);
    const int64_t n_all = 300;
    std::vector<float> x;
    const std::vector<uint16_t> x_bits = testing::random_bf16(static_cast<size_t>(n_all * sh.n_in), 1.0f, 11, &x);
    const LinearCase c{sh.format, sh.n_out, sh.n_in, {}, sh.out};
    auto run = [&](int64_t first, int64_t n) {
      const std::vector<uint16_t> part(x_bits.begin() + first * sh.n_in, x_bits.begin() + (first + n) * sh.n_in);
      LinearCudaParams p{n, sh.out, LinearPath::kAuto, true};
      cuda::DeviceBuffer dx = cuda::upload(part);
      const size_t out_elem = sh.out == LinearOutType::kF32 ? 4 : 2;
      cuda::DeviceBuffer dy(static_cast<size_t>(n * sh.n_out) * out_elem);
      cuda::DeviceBuffer scratch(linear_dequant_scratch_bytes(dw.desc, p));
      const LinearCudaContext ctx{cub.handle, cub.workspace.data(), cub.workspace.bytes(), scratch.data(),
                                  scratch.bytes()};
      linear_cuda(p, dw.desc, dx.as<__nv_bfloat16>(), dy.data(), ctx, nullptr);
      BG_CUDA_CHECK(cudaDeviceSynchronize());
      if (sh.out == LinearOutType::kF32) return cuda::download<float>(dy, static_cast<size_t>(n * sh.n_out));
      return testing::from_bf16(cuda::download<uint16_t>(dy, static_cast<size_t>(n * sh.n_out)));
    };
    const std::vector<float> all = run(0, n_all);
    std::vector<float> ref(static_cast<size_t>(n_all * sh.n_out));
    linear_cpu(hw.w, x.data(), n_all, ref.data());
    testing::expect_parity(all, ref, tolerance(c, n_all), describe(c, n_all) + " deterministic");
    for (const auto& [first, n] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 1}, {5, 1}, {17, 3}, {0, 16}, {40, 17}, {63, 64}, {1, 65}, {100, 128}, {7, 200}}) {
      const std::vector<float> got = run(first, n);
      int64_t differ = 0;
      for (int64_t i = 0; i < n * sh.n_out; ++i) {
        const float a = got[static_cast<size_t>(i)], b = all[static_cast<size_t>(first * sh.n_out + i)];
        differ += std::memcmp(&a, &b, sizeof a) != 0;
      }
      EXPECT_EQ(differ, 0) << describe(c, n) << ": rows " << first << ".." << first + n
                           << " differ from the same rows in a call of " << n_all;
    }
  }
}

}  // namespace bg::ops
