// Quantized linear weights through load_linear on written checkpoints: MXFP4 (both namings) and FP8 block decode
// against hand-computed values, quantizer round trips with error bounds, and shape/dtype errors naming the tensor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "core/tensor.h"
#include "formats/checkpoint.h"
#include "formats/formats_testing.h"
#include "formats/quant.h"
#include "formats/safetensors.h"

namespace bg {
namespace {

using testing::expect_error;
using testing::TempDir;

// E2M1 code -> value, written out by hand from the OCP MX spec (codes 8..15 are the negatives).
constexpr float kE2M1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

std::unique_ptr<Checkpoint> write_checkpoint(const TempDir& dir, const std::vector<NamedTensor>& tensors) {
  write_safetensors(dir / "model.safetensors", tensors);
  return Checkpoint::open(dir.path());
}

HostTensor u8_tensor(Shape shape, const std::vector<uint8_t>& bytes) {
  HostTensor t(DType::kU8, std::move(shape));
  EXPECT_EQ(t.nbytes(), bytes.size());
  std::memcpy(t.data(), bytes.data(), std::min(t.nbytes(), bytes.size()));
  return t;
}

// MXFP4 test weight: [2, 64] = 2 rows x 2 groups of 32. Byte k of row r holds element 2k in its low nibble and
// element 2k+1 in its high nibble.
constexpr int64_t kOut = 2, kIn = 64;
uint8_t lo_code(int64_t r, int64_t k) { return static_cast<uint8_t>((k + 5 * r) % 16); }
uint8_t hi_code(int64_t r, int64_t k) { return static_cast<uint8_t>((7 * k + 3 + r) % 16); }
const std::vector<uint8_t> kScaleBytes = {127, 129, 125, 131};  // row 0: 1, 4; row 1: 1/4, 16
const float kScaleValues[2][2] = {{1.0f, 4.0f}, {0.25f, 16.0f}};

std::vector<uint8_t> mxfp4_bytes() {
  std::vector<uint8_t> out;
  for (int64_t r = 0; r < kOut; ++r)
    for (int64_t k = 0; k < kIn / 2; ++k) out.push_back(static_cast<uint8_t>(lo_code(r, k) | (hi_code(r, k) << 4)));
  return out;
}

void expect_mxfp4_decode(const QuantWeight& w) {
  ASSERT_EQ(w.format, WeightFormat::kMxfp4);
  std::vector<float> got = w.decode_all();
  ASSERT_EQ(got.size(), static_cast<size_t>(kOut * kIn));
  for (int64_t r = 0; r < kOut; ++r) {
    for (int64_t k = 0; k < kIn / 2; ++k) {
      float s = kScaleValues[r][k / 16];
      EXPECT_EQ(got[r * kIn + 2 * k], kE2M1[lo_code(r, k)] * s) << r << "," << 2 * k;
      EXPECT_EQ(got[r * kIn + 2 * k + 1], kE2M1[hi_code(r, k)] * s) << r << "," << 2 * k + 1;
    }
  }
  // Spot values worked out by hand from the byte pattern above.
  EXPECT_EQ(got[0], 0.0f);                  // r0 k0: lo 0
  EXPECT_EQ(got[1], 1.5f);                  // r0 k0: hi 3
  EXPECT_EQ(got[2], 0.5f);                  // r0 k1: lo 1
  EXPECT_EQ(got[3], -1.0f);                 // r0 k1: hi 10
  EXPECT_EQ(got[33], 6.0f);                 // r0 k16: hi 3 (1.5) x scale 4
  EXPECT_EQ(got[kIn + 7], -0.125f);         // r1 k3: hi 9 (-0.5) x 1/4
  EXPECT_TRUE(std::signbit(got[kIn + 6]));  // r1 k3: lo 8 is -0
  EXPECT_EQ(got[kIn + 62], 32.0f);          // r1 k31: lo 4 (2) x 16
  EXPECT_EQ(got[kIn + 63], -48.0f);         // r1 k31: hi 13 (-3) x 16
}

TEST(Quant, Mxfp4BlocksNaming) {
  TempDir dir;
  HostTensor blocks = u8_tensor({kOut, kIn / 32, 16}, mxfp4_bytes());
  HostTensor scales = u8_tensor({kOut, kIn / 32}, kScaleBytes);
  auto ckpt = write_checkpoint(dir, {{"p.weight_blocks", blocks.view()}, {"p.weight_scales", scales.view()}});
  expect_mxfp4_decode(load_linear(*ckpt, "p", kOut, kIn));
}

TEST(Quant, Mxfp4PackedNaming) {
  TempDir dir;
  HostTensor packed = u8_tensor({kOut, kIn / 2}, mxfp4_bytes());
  HostTensor scale = u8_tensor({kOut, kIn / 32}, kScaleBytes);
  auto ckpt = write_checkpoint(dir, {{"p.weight_packed", packed.view()}, {"p.weight_scale", scale.view()}});
  expect_mxfp4_decode(load_linear(*ckpt, "p", kOut, kIn));
}

TEST(Quant, Mxfp4SingleByteNibbleOrderAndNanScale) {
  TempDir dir;
  std::vector<uint8_t> bytes(32, 0);
  bytes[0] = 0x71;  // element 0 = code 1 (0.5), element 1 = code 7 (6)
  bytes[5] = 0xc2;  // element 10 = code 2 (1), element 11 = code 12 (-2)
  std::copy(bytes.begin(), bytes.begin() + 16, bytes.begin() + 16);  // row 1: same codes
  HostTensor packed = u8_tensor({2, 16}, bytes);
  HostTensor scale = u8_tensor({2, 1}, {128, 0xff});  // row 0 x2; row 1 NaN scale
  auto ckpt = write_checkpoint(dir, {{"p.weight_packed", packed.view()}, {"p.weight_scale", scale.view()}});
  std::vector<float> w = load_linear(*ckpt, "p", 2, 32).decode_all();
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_EQ(w[1], 12.0f);
  EXPECT_EQ(w[10], 2.0f);
  EXPECT_EQ(w[11], -4.0f);
  EXPECT_EQ(w[2], 0.0f);
  for (int i = 32; i < 64; ++i) EXPECT_TRUE(std::isnan(w[i])) << i;  // a NaN scale makes the block NaN
}

// FP8 block weight with ragged edges: [130, 200] has blocks of 128 and 2 rows, 128 and 72 columns.
constexpr int64_t kFp8Out = 130, kFp8In = 200;
constexpr uint8_t kFp8Codes[5] = {0x38, 0x40, 0xb8, 0x3c, 0x30};
constexpr float kFp8Values[5] = {1.0f, 2.0f, -1.0f, 1.5f, 0.5f};  // e4m3: 2^(e-7) x (1 + m/8)
constexpr float kFp8Scales[2][2] = {{2.0f, 0.5f}, {4.0f, 0.25f}};

TEST(Quant, Fp8BlockRaggedEdges) {
  TempDir dir;
  HostTensor codes(DType::kF8E4M3, {kFp8Out, kFp8In});
  for (int64_t r = 0; r < kFp8Out; ++r)
    for (int64_t c = 0; c < kFp8In; ++c) codes.data()[r * kFp8In + c] = std::byte{kFp8Codes[(r + c) % 5]};
  HostTensor scale_inv = HostTensor::from_f32(std::vector<float>{2.0f, 0.5f, 4.0f, 0.25f}, {2, 2});
  auto ckpt = write_checkpoint(dir, {{"p.weight", codes.view()}, {"p.weight_scale_inv", scale_inv.view()}});
  QuantWeight w = load_linear(*ckpt, "p", kFp8Out, kFp8In);
  ASSERT_EQ(w.format, WeightFormat::kFp8Block);
  std::vector<float> got = w.decode_all();
  for (int64_t r = 0; r < kFp8Out; ++r) {
    for (int64_t c = 0; c < kFp8In; ++c) {
      ASSERT_EQ(got[r * kFp8In + c], kFp8Values[(r + c) % 5] * kFp8Scales[r / 128][c / 128]) << r << "," << c;
    }
  }
  auto at = [&](int64_t r, int64_t c) { return got[r * kFp8In + c]; };
  EXPECT_EQ(at(0, 0), 2.0f);      // 1.0 x 2
  EXPECT_EQ(at(127, 127), 1.0f);  // (254 % 5 = 4) 0.5 x 2
  EXPECT_EQ(at(127, 128), 0.5f);  // 1.0 x 0.5: first column of the ragged column block
  EXPECT_EQ(at(128, 127), 4.0f);  // 1.0 x 4: first row of the ragged row block
  EXPECT_EQ(at(129, 199), 0.375f);  // (328 % 5 = 3) 1.5 x 0.25: the last element
  // decode_row agrees with decode_all on the ragged row.
  std::vector<float> row(kFp8In);
  w.decode_row(129, row.data());
  EXPECT_EQ(row[199], 0.375f);
  EXPECT_EQ(row[0], kFp8Values[129 % 5] * 4.0f);
}

TEST(Quant, Fp8ScaleShapeMustBeCeil) {
  TempDir dir;
  HostTensor codes(DType::kF8E4M3, {kFp8Out, kFp8In});
  HostTensor floor_scale = HostTensor::from_f32(std::vector<float>{1.0f, 1.0f}, {1, 2});  // floor(130/128) rows
  auto ckpt = write_checkpoint(dir, {{"p.weight", codes.view()}, {"p.weight_scale_inv", floor_scale.view()}});
  expect_error([&] { load_linear(*ckpt, "p", kFp8Out, kFp8In); },
               {"tensor 'p.weight_scale_inv' in model.safetensors", "shape [1, 2]", "needs [2, 2]"});
}

std::vector<float> random_matrix(int64_t n_out, int64_t n_in, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(n_out * n_in));
  for (auto& v : w) v = dist(gen);
  return w;
}

TEST(Quant, QuantizeFp8BlockRoundTrip) {
  auto w = random_matrix(kFp8Out, kFp8In, 1);
  // Give each block its own magnitude; the bottom-right block is all zero (scale 1, codes 0).
  for (int64_t r = 0; r < kFp8Out; ++r) {
    for (int64_t c = 0; c < kFp8In; ++c) {
      const float mag[2][2] = {{1.0f, 300.0f}, {1e-3f, 0.0f}};
      w[r * kFp8In + c] *= mag[r / 128][c / 128];
    }
  }
  HostTensor codes, scale_inv;
  quantize_fp8_block(w.data(), kFp8Out, kFp8In, &codes, &scale_inv);
  ASSERT_EQ(codes.shape(), (Shape{kFp8Out, kFp8In}));
  ASSERT_EQ(scale_inv.shape(), (Shape{2, 2}));
  std::vector<float> scales = scale_inv.view().to_f32();
  for (int bi = 0; bi < 2; ++bi) {
    for (int bj = 0; bj < 2; ++bj) {
      float amax = 0;
      for (int64_t r = bi * 128; r < std::min<int64_t>(kFp8Out, bi * 128 + 128); ++r)
        for (int64_t c = bj * 128; c < std::min<int64_t>(kFp8In, bj * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(w[r * kFp8In + c]));
      EXPECT_FLOAT_EQ(scales[bi * 2 + bj], amax > 0 ? amax / 448.0f : 1.0f) << bi << "," << bj;
    }
  }
  // Through a written checkpoint, so the stored form is what gets decoded.
  TempDir dir;
  auto ckpt = write_checkpoint(dir, {{"p.weight", codes.view()}, {"p.weight_scale_inv", scale_inv.view()}});
  std::vector<float> got = load_linear(*ckpt, "p", kFp8Out, kFp8In).decode_all();
  for (int64_t r = 0; r < kFp8Out; ++r) {
    for (int64_t c = 0; c < kFp8In; ++c) {
      float x = w[r * kFp8In + c], s = scales[(r / 128) * 2 + c / 128];
      // e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; subnormals step by 2^-9 (x scale).
      float bound = std::fabs(x) * 0.0625f + s * std::ldexp(1.0f, -10) + std::fabs(x) * 1e-6f;
      ASSERT_LE(std::fabs(got[r * kFp8In + c] - x), bound) << r << "," << c << " x=" << x;
    }
  }
  for (int64_t r = 128; r < kFp8Out; ++r)
    for (int64_t c = 128; c < kFp8In; ++c) EXPECT_EQ(got[r * kFp8In + c], 0.0f);
}

TEST(Quant, QuantizeMxfp4ExactForRepresentableValues) {
  // Each group holds E2M1 values x 2^k with 6 x 2^k present, so the scale is exactly 2^k and nothing rounds.
  const int k_of_group[3] = {-3, 0, 5};
  std::vector<float> w(2 * 96);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t i = 0; i < 96; ++i)
      w[r * 96 + i] = std::ldexp(kE2M1[(i + r) % 16], k_of_group[i / 32]) * (i % 32 == 31 ? 0.0f : 1.0f);
  for (int64_t r = 0; r < 2; ++r)
    for (int g = 0; g < 3; ++g) w[r * 96 + g * 32 + 31] = std::ldexp(6.0f, k_of_group[g]);
  HostTensor codes, scales;
  quantize_mxfp4(w.data(), 2, 96, &codes, &scales);
  ASSERT_EQ(codes.shape(), (Shape{2, 48}));
  ASSERT_EQ(scales.shape(), (Shape{2, 3}));
  auto* s = reinterpret_cast<const uint8_t*>(scales.data());
  EXPECT_EQ(s[0], 124);
  EXPECT_EQ(s[1], 127);
  EXPECT_EQ(s[2], 132);
  TempDir dir;
  auto ckpt = write_checkpoint(dir, {{"p.weight_packed", codes.view()}, {"p.weight_scale", scales.view()}});
  std::vector<float> got = load_linear(*ckpt, "p", 2, 96).decode_all();
  for (size_t i = 0; i < w.size(); ++i) EXPECT_EQ(got[i], w[i]) << i;
}

// The FP8 path's premise (docs/MOE_PREFILL.md, "Next: the FP8 path"): an MXFP4 weight c 2^(s - 127) is exactly the
// E4M3 value c 2^(s - S) times 2^(S - 127) for every group exponent s with -8 <= s - S <= 6, so a 128 x 128 block whose
// groups' exponents span at most 14 binades converts without rounding; one binade more on either side does not.
TEST(Quant, Mxfp4CodesAreExactE4m3WithinFourteenBinades) {
  const auto exact = [](float v) { return f8e4m3_to_f32(f32_to_f8e4m3(v)) == v; };
  for (int d = -8; d <= 6; ++d) {
    for (int code = 0; code < 16; ++code) {
      const float v = std::ldexp(e2m1_to_f32(static_cast<uint8_t>(code)), d);
      EXPECT_TRUE(exact(v)) << "code " << code << " at 2^" << d;
    }
  }
  bool low = true, high = true;  // some code fails one binade past each end
  for (int code = 0; code < 16; ++code) {
    low = low && exact(std::ldexp(e2m1_to_f32(static_cast<uint8_t>(code)), -9));
    high = high && exact(std::ldexp(e2m1_to_f32(static_cast<uint8_t>(code)), 7));
  }
  EXPECT_FALSE(low) << "2^-9 keeps every code exact: the window is wider than documented";
  EXPECT_FALSE(high) << "2^7 keeps every code exact: the window is wider than documented";
}

TEST(Quant, QuantizeMxfp4ErrorBound) {
  constexpr int64_t n_out = 8, n_in = 128;
  auto w = random_matrix(n_out, n_in, 2);
  for (size_t i = 0; i < w.size(); ++i) w[i] *= std::ldexp(1.0f, static_cast<int>(i / 32 % 7) - 3);
  HostTensor codes, scales;
  quantize_mxfp4(w.data(), n_out, n_in, &codes, &scales);
  TempDir dir;
  HostTensor blocks(DType::kU8, {n_out, n_in / 32, 16});  // the same bytes in the gpt-oss [out, in/32, 16] naming
  ASSERT_EQ(blocks.nbytes(), codes.nbytes());
  std::memcpy(blocks.data(), codes.data(), codes.nbytes());
  auto ckpt = write_checkpoint(dir, {{"p.weight_blocks", blocks.view()}, {"p.weight_scales", scales.view()}});
  std::vector<float> got = load_linear(*ckpt, "p", n_out, n_in).decode_all();
  for (int64_t r = 0; r < n_out; ++r) {
    for (int64_t g = 0; g < n_in / 32; ++g) {
      float amax = 0;
      for (int64_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(w[r * n_in + g * 32 + j]));
      // The scale puts amax in [4, 8) x 2^e; E2M1 steps are 0.5 below 2, 1 in [2, 4], 2 in [4, 6]; above 6 clips.
      int e = static_cast<int>(std::floor(std::log2(amax))) - 2;
      float unit = std::ldexp(1.0f, e);
      for (int64_t j = 0; j < 32; ++j) {
        size_t i = static_cast<size_t>(r * n_in + g * 32 + j);
        float x = std::fabs(w[i]) / unit, err = std::fabs(got[i] - w[i]) / unit;
        float bound = x <= 2.0f ? 0.25f : (x <= 4.0f ? 0.5f : (x <= 6.0f ? 1.0f : x - 6.0f));
        ASSERT_LE(err, bound + 1e-6f) << r << "," << g * 32 + j << " x=" << w[i] << " got " << got[i];
        ASSERT_LE(err, 2.0f);  // never more than amax / 2
      }
    }
  }
  expect_error([&] { quantize_mxfp4(w.data(), 1, 48, &codes, &scales); }, {"input dim 48 is not a multiple of 32"});
}

TEST(Quant, DenseWeights) {
  TempDir dir;
  HostTensor bf16(DType::kBF16, {2, 2});
  const uint16_t bits[4] = {0x3f80, 0xc000, 0x3fc0, 0x0000};  // 1, -2, 1.5, 0
  std::memcpy(bf16.data(), bits, sizeof(bits));
  HostTensor f32 = HostTensor::from_f32(std::vector<float>{0.25f, -8.0f}, {1, 2});
  auto ckpt = write_checkpoint(dir, {{"b.weight", bf16.view()}, {"f.weight", f32.view()}});
  QuantWeight b = load_linear(*ckpt, "b", 2, 2);
  EXPECT_EQ(b.format, WeightFormat::kDense);
  EXPECT_EQ(b.decode_all(), (std::vector<float>{1.0f, -2.0f, 1.5f, 0.0f}));
  EXPECT_EQ(load_linear(*ckpt, "f", 1, 2).decode_all(), (std::vector<float>{0.25f, -8.0f}));
}

TEST(Quant, LoadLinearErrorsNameTheTensor) {
  TempDir dir;
  HostTensor dense = HostTensor::from_f32(std::vector<float>(12, 1.0f), {3, 4});
  HostTensor i32(DType::kI32, {4, 4});
  HostTensor fp8(DType::kF8E4M3, {4, 4});
  HostTensor bf16_scale(DType::kBF16, {1, 1});
  HostTensor int4_packed(DType::kI32, {4, 8});  // compressed-tensors INT4 layout [out, in/8]
  HostTensor u8_packed(DType::kU8, {4, 32});
  HostTensor bf16_group_scale(DType::kBF16, {4, 2});
  HostTensor bad_blocks(DType::kU8, {4, 32});  // should be [4, 2, 16]
  HostTensor blocks(DType::kU8, {4, 2, 16});
  HostTensor f32_scales(DType::kF32, {4, 2});
  auto ckpt = write_checkpoint(dir, {{"dense.weight", dense.view()},
                                     {"int.weight", i32.view()},
                                     {"noscale.weight", fp8.view()},
                                     {"badscale.weight", fp8.view()},
                                     {"badscale.weight_scale_inv", bf16_scale.view()},
                                     {"int4.weight_packed", int4_packed.view()},
                                     {"ct.weight_packed", u8_packed.view()},
                                     {"ct.weight_scale", bf16_group_scale.view()},
                                     {"ctmiss.weight_packed", u8_packed.view()},
                                     {"blk.weight_blocks", bad_blocks.view()},
                                     {"blkmiss.weight_blocks", blocks.view()},
                                     {"blkscale.weight_blocks", blocks.view()},
                                     {"blkscale.weight_scales", f32_scales.view()}});
  const std::string file = "model.safetensors";
  expect_error([&] { load_linear(*ckpt, "dense", 4, 4); },
               {"tensor 'dense.weight' in " + file, "shape [3, 4] but the architecture needs [4, 4]"});
  expect_error([&] { load_linear(*ckpt, "int", 4, 4); },
               {"tensor 'int.weight'", "dtype I32 is not a supported linear weight type"});
  expect_error([&] { load_linear(*ckpt, "noscale", 4, 4); }, {"missing tensor 'noscale.weight_scale_inv'"});
  expect_error([&] { load_linear(*ckpt, "badscale", 4, 4); },
               {"tensor 'badscale.weight_scale_inv'", "dtype BF16 but F32 is required"});
  expect_error([&] { load_linear(*ckpt, "int4", 4, 64); }, {"tensor 'int4.weight_packed'", "dtype I32"});
  expect_error([&] { load_linear(*ckpt, "ct", 4, 32); }, {"tensor 'ct.weight_packed'", "shape [4, 32]", "[4, 16]"});
  expect_error([&] { load_linear(*ckpt, "ct", 4, 64); }, {"tensor 'ct.weight_scale'", "dtype BF16 but U8"});
  expect_error([&] { load_linear(*ckpt, "ct", 4, 48); }, {"'ct'", "input dim 48 is not a multiple of 32"});
  expect_error([&] { load_linear(*ckpt, "ctmiss", 4, 64); }, {"missing tensor 'ctmiss.weight_scale'"});
  expect_error([&] { load_linear(*ckpt, "blk", 4, 64); }, {"tensor 'blk.weight_blocks'", "needs [4, 2, 16]"});
  expect_error([&] { load_linear(*ckpt, "blkmiss", 4, 64); }, {"missing tensor 'blkmiss.weight_scales'"});
  expect_error([&] { load_linear(*ckpt, "blkscale", 4, 64); }, {"tensor 'blkscale.weight_scales'", "dtype F32"});
  expect_error([&] { load_linear(*ckpt, "absent", 4, 4); }, {"missing tensor 'absent.weight'"});
}

TEST(Quant, LinearTensorNames) {
  EXPECT_EQ(linear_tensor_names("p", WeightFormat::kDense, false), (std::vector<std::string>{"p.weight"}));
  EXPECT_EQ(linear_tensor_names("p", WeightFormat::kFp8Block, false),
            (std::vector<std::string>{"p.weight", "p.weight_scale_inv"}));
  EXPECT_EQ(linear_tensor_names("p", WeightFormat::kMxfp4, false),
            (std::vector<std::string>{"p.weight_blocks", "p.weight_scales"}));
  EXPECT_EQ(linear_tensor_names("p", WeightFormat::kMxfp4, true),
            (std::vector<std::string>{"p.weight_packed", "p.weight_scale"}));
  EXPECT_EQ(weight_format_name(WeightFormat::kFp8Block), "fp8-block");
}

}  // namespace
}  // namespace bg
