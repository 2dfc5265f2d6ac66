// linear_cpu against a double matmul for dense F32/BF16, FP8 block (ragged edges) and MXFP4 (both namings) weights
// built from HostTensors, over 0, 1 and 7 tokens; embedding_cpu lookups and out-of-range ids.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "formats/quant.h"
#include "ops/linear/linear.h"
#include "ops/linear/linear_decode_plan.h"

namespace bg::ops {
namespace {

std::vector<float> normal_vector(int64_t n, float stddev, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = normal(rng);
  return v;
}

HostTensor bf16_tensor(const std::vector<float>& values, Shape shape) {
  HostTensor t(DType::kBF16, std::move(shape));
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t b = f32_to_bf16(values[i]);
    std::memcpy(t.data() + 2 * i, &b, 2);
  }
  return t;
}

QuantWeight make_weight(WeightFormat format, int64_t n_out, int64_t n_in, TensorView data, TensorView scale = {}) {
  return QuantWeight{format, n_out, n_in, std::move(data), std::move(scale), std::string("w"), {}};
}

// y = x W^T in double over the given fp32 weight values [n_out, n_in]; `bound` gets sum |w x| per output (the scale
// of fp32 accumulation error).
void reference_matmul(const std::vector<float>& w, int64_t n_out, int64_t n_in, const std::vector<float>& x,
                      int64_t n_tokens, std::vector<double>* y, std::vector<double>* bound) {
  y->assign(static_cast<size_t>(n_tokens * n_out), 0.0);
  bound->assign(y->size(), 0.0);
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t r = 0; r < n_out; ++r) {
      double s = 0.0, b = 0.0;
      for (int64_t i = 0; i < n_in; ++i) {
        double term = static_cast<double>(w[static_cast<size_t>(r * n_in + i)]) * x[static_cast<size_t>(t * n_in + i)];
        s += term;
        b += std::abs(term);
      }
      (*y)[static_cast<size_t>(t * n_out + r)] = s;
      (*bound)[static_cast<size_t>(t * n_out + r)] = b;
    }
  }
}

// Runs linear_cpu for 0, 1 and 7 tokens and compares with the double matmul over `w_values` (what the weight
// represents exactly).
void check_linear(const QuantWeight& w, const std::vector<float>& w_values, const std::string& what) {
  ASSERT_EQ(w_values.size(), static_cast<size_t>(w.n_out * w.n_in));
  for (int64_t n_tokens : {0, 1, 7}) {
    std::vector<float> x = normal_vector(n_tokens * w.n_in, 1.0f, static_cast<uint32_t>(n_tokens + 3));
    // One extra row of sentinels after the output: nothing past n_tokens rows may be written.
    std::vector<float> y(static_cast<size_t>((n_tokens + 1) * w.n_out), -12345.0f);
    linear_cpu(w, x.data(), n_tokens, y.data());
    std::vector<double> want, bound;
    reference_matmul(w_values, w.n_out, w.n_in, x, n_tokens, &want, &bound);
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(y[i], want[i], 5e-6 * bound[i] + 1e-30) << what << " tokens " << n_tokens << " index " << i;
    for (size_t i = want.size(); i < y.size(); ++i) ASSERT_EQ(y[i], -12345.0f) << what << " wrote past the output";
  }
}

TEST(Linear, DenseF32) {
  const int64_t n_out = 37, n_in = 53;
  std::vector<float> w = normal_vector(n_out * n_in, 0.5f, 1);
  HostTensor t = HostTensor::from_f32(w, {n_out, n_in});
  QuantWeight q = make_weight(WeightFormat::kDense, n_out, n_in, t.view("w.weight"));
  check_linear(q, w, "f32");
}

TEST(Linear, DenseBf16) {
  const int64_t n_out = 19, n_in = 130;
  std::vector<float> w = normal_vector(n_out * n_in, 0.5f, 2);
  HostTensor t = bf16_tensor(w, {n_out, n_in});
  // The exact weight values are the bf16-rounded ones.
  std::vector<float> rounded(w.size());
  for (size_t i = 0; i < w.size(); ++i) rounded[i] = bf16_to_f32(f32_to_bf16(w[i]));
  size_t n_changed = 0;
  for (size_t i = 0; i < w.size(); ++i) n_changed += rounded[i] != w[i];
  ASSERT_GT(n_changed, w.size() / 2);  // rounding matters, so reading the bytes as fp32 would be caught
  QuantWeight q = make_weight(WeightFormat::kDense, n_out, n_in, t.view("w.weight"));
  check_linear(q, rounded, "bf16");
}

TEST(Linear, Fp8BlockRagged) {
  // 130 x 200: 2 x 2 blocks of 128, the last row and column blocks ragged (2 rows, 72 columns). Each block gets a
  // different magnitude, so a wrong block scale is a large error.
  const int64_t n_out = 130, n_in = 200;
  std::vector<float> w = normal_vector(n_out * n_in, 1.0f, 3);
  for (int64_t r = 0; r < n_out; ++r)
    for (int64_t i = 0; i < n_in; ++i)
      w[static_cast<size_t>(r * n_in + i)] *= (r >= 128 ? 20.0f : 1.0f) * (i >= 128 ? 0.01f : 1.0f);
  HostTensor codes, scale_inv;
  quantize_fp8_block(w.data(), n_out, n_in, &codes, &scale_inv);
  ASSERT_EQ(scale_inv.shape(), (Shape{2, 2}));
  QuantWeight q =
      make_weight(WeightFormat::kFp8Block, n_out, n_in, codes.view("w.weight"), scale_inv.view("w.weight_scale_inv"));
  std::vector<float> decoded = q.decode_all();
  // Sanity: the decoded matrix is the original to fp8 precision (3 mantissa bits) in every block.
  const float* s = reinterpret_cast<const float*>(scale_inv.data());
  for (int64_t r = 0; r < n_out; ++r) {
    for (int64_t i = 0; i < n_in; ++i) {
      size_t k = static_cast<size_t>(r * n_in + i);
      float block_scale = s[(r / 128) * 2 + i / 128];
      ASSERT_NEAR(decoded[k], w[k], 0.0625 * std::abs(w[k]) + block_scale * 0x1p-9f) << r << "," << i;
    }
  }
  check_linear(q, decoded, "fp8");
}

TEST(Linear, Mxfp4BothNamings) {
  const int64_t n_out = 45, n_in = 96;  // 3 groups of 32 per row
  std::vector<float> w = normal_vector(n_out * n_in, 1.0f, 4);
  for (int64_t r = 0; r < n_out; ++r)
    for (int64_t i = 0; i < n_in; ++i)
      w[static_cast<size_t>(r * n_in + i)] *= std::ldexp(1.0f, static_cast<int>(i / 32) * 3 - 3);
  HostTensor codes, scales;
  quantize_mxfp4(w.data(), n_out, n_in, &codes, &scales);
  // gpt-oss naming: `.weight_blocks` [out, in/32, 16]; compressed-tensors naming: `.weight_packed` [out, in/2]. The
  // bytes are the same.
  HostTensor blocks(DType::kU8, {n_out, n_in / 32, 16});
  ASSERT_EQ(blocks.nbytes(), codes.nbytes());
  std::memcpy(blocks.data(), codes.data(), codes.nbytes());
  QuantWeight packed =
      make_weight(WeightFormat::kMxfp4, n_out, n_in, codes.view("w.weight_packed"), scales.view("w.weight_scale"));
  QuantWeight blocked =
      make_weight(WeightFormat::kMxfp4, n_out, n_in, blocks.view("w.weight_blocks"), scales.view("w.weight_scales"));
  std::vector<float> decoded = packed.decode_all();
  ASSERT_EQ(blocked.decode_all(), decoded);
  // Sanity: the decode tracks the original (E2M1 keeps the sign and is within half the group's max).
  size_t n_nonzero = 0;
  for (size_t k = 0; k < w.size(); ++k) {
    n_nonzero += decoded[k] != 0.0f;
    if (decoded[k] != 0.0f) {
      ASSERT_EQ(std::signbit(decoded[k]), std::signbit(w[k])) << k;
    }
  }
  ASSERT_GT(n_nonzero, w.size() / 2);
  check_linear(packed, decoded, "mxfp4 packed");
  check_linear(blocked, decoded, "mxfp4 blocks");
}

TEST(Linear, RejectsEmptyWeight) {
  QuantWeight q;
  float x = 1.0f, y = 0.0f;
  EXPECT_THROW(linear_cpu(q, &x, 1, &y), Error);
}

TEST(Embedding, LooksUpRowsF32AndBf16) {
  const int64_t vocab = 10, dim = 6;
  std::vector<float> table = normal_vector(vocab * dim, 1.0f, 5);
  HostTensor f32 = HostTensor::from_f32(table, {vocab, dim});
  HostTensor bf16 = bf16_tensor(table, {vocab, dim});
  const std::vector<int32_t> ids = {3, 0, 9, 3};
  std::vector<float> y(ids.size() * dim), yb(y.size());
  embedding_cpu(f32.view("embed"), ids.data(), 4, y.data());
  embedding_cpu(bf16.view("embed"), ids.data(), 4, yb.data());
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t i = 0; i < dim; ++i) {
      float v = table[static_cast<size_t>(ids[t] * dim + i)];
      EXPECT_EQ(y[t * dim + static_cast<size_t>(i)], v);
      EXPECT_EQ(yb[t * dim + static_cast<size_t>(i)], bf16_to_f32(f32_to_bf16(v)));
    }
  }
}

TEST(Embedding, RejectsOutOfRangeIds) {
  HostTensor t = HostTensor::from_f32(std::vector<float>(20, 1.0f), {5, 4});
  std::vector<float> y(8);
  for (int32_t bad : {-1, 5, 1 << 30}) {
    const int32_t ids[2] = {1, bad};
    EXPECT_THROW(embedding_cpu(t.view("embed"), ids, 2, y.data()), Error) << bad;
  }
  const int32_t ok[2] = {0, 4};
  EXPECT_NO_THROW(embedding_cpu(t.view("embed"), ok, 2, y.data()));
}

}  // namespace
}  // namespace bg::ops

namespace bg::ops {
namespace {

// The dense decode GEMM's geometry (linear_decode_plan.h) on a 132-SM GPU: tile shape by token count, the k-split
// that fills the resident slots when the row tiles alone do not, and its caps.
TEST(DenseDecodePlan, TileShapeSplitsAndCaps) {
  const size_t bytes = size_t{16} << 20;
  struct Shape {
    int64_t tokens;
    int nb, m_tiles;
  };
  for (const Shape& s : {Shape{1, 1, 1}, Shape{8, 1, 1}, Shape{9, 2, 1}, Shape{16, 2, 1}, Shape{17, 4, 1},
                         Shape{32, 4, 1}, Shape{33, 8, 2}, Shape{64, 8, 2}}) {
    const DenseDecodePlan p = dense_decode_plan(7168, 12288, s.tokens, 132, bytes, 8192);
    EXPECT_EQ(p.nb, s.nb) << s.tokens;
    EXPECT_EQ(p.m_tiles, s.m_tiles) << s.tokens;
    EXPECT_EQ(p.rows, 128 * s.m_tiles);
    EXPECT_EQ(p.ctas_per_sm, s.m_tiles == 2 ? 1 : 2);
    EXPECT_EQ(p.stages, 192);
    EXPECT_EQ(p.slot_floats, static_cast<size_t>(p.rows * 8 * p.nb));
  }
  // o_proj 12288 -> 7168: 56 tiles of 128 rows in 264 slots (4 splits), 28 of 256 rows in 132 (4 splits).
  EXPECT_EQ(dense_decode_plan(7168, 12288, 16, 132, bytes, 8192).splits, 4);
  EXPECT_EQ(dense_decode_plan(7168, 12288, 64, 132, bytes, 8192).splits, 4);
  // lm_head: 1280 row tiles fill the GPU alone.
  EXPECT_EQ(dense_decode_plan(163840, 7168, 1, 132, bytes, 8192).splits, 1);
  // Router 7168 -> 896: 7 tiles would take 37 splits; at least 8 of the 112 stages each caps them at 14.
  EXPECT_EQ(dense_decode_plan(896, 7168, 1, 132, bytes, 8192).splits, 14);
  // Fewer than 16 stages: no split.
  EXPECT_EQ(dense_decode_plan(128, 960, 1, 132, bytes, 8192).splits, 1);
  // The partial sums must fit: 7 tiles x 14 splits x 128 x 8 floats = 392 KiB; with 300 KiB, 10 splits.
  EXPECT_EQ(dense_decode_plan(896, 7168, 1, 132, 300 << 10, 8192).splits, 10);
  // More split tiles than counters: no split.
  EXPECT_EQ(dense_decode_plan(896, 7168, 1, 132, bytes, 6).splits, 1);
  // Forced: as asked, at most one stage each, within the buffer.
  EXPECT_EQ(dense_decode_plan(7168, 12288, 64, 132, bytes, 8192, 9).splits, 9);
  EXPECT_EQ(dense_decode_plan(128, 128, 1, 132, bytes, 8192, 9).splits, 2);
  EXPECT_EQ(dense_decode_plan(7168, 12288, 64, 132, size_t{1} << 20, 8192, 9).splits, 1);
}

}  // namespace
}  // namespace bg::ops
