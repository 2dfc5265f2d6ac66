// Decoders and quantizers for FP8-block and MXFP4 linear weights.
#include "formats/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "formats/weight_source.h"

namespace bg {
namespace {

void check_shape(const TensorView& t, const Shape& want, const std::string& file) {
  BG_CHECK(t.shape == want, "tensor '{}' in {}: shape {} but the architecture needs {}", t.name, file,
           shape_str(t.shape), shape_str(want));
}

void check_dtype(const TensorView& t, DType want, const std::string& file) {
  BG_CHECK(t.dtype == want, "tensor '{}' in {}: dtype {} but {} is required", t.name, file, dtype_name(t.dtype),
           dtype_name(want));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::string_view weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::kDense: return "dense";
    case WeightFormat::kFp8Block: return "fp8-block";
    case WeightFormat::kMxfp4: return "mxfp4";
  }
  return "?";
}

void QuantWeight::decode_row(int64_t r, float* out) const {
  switch (format) {
    case WeightFormat::kDense: {
      const std::byte* row = data.data + static_cast<size_t>(r * n_in) * dtype_size_bytes(data.dtype);
      if (data.dtype == DType::kF32) {
        std::memcpy(out, row, static_cast<size_t>(n_in) * sizeof(float));
      } else if (data.dtype == DType::kBF16) {
        for (int64_t i = 0; i < n_in; ++i) {
          uint16_t b;
          std::memcpy(&b, row + 2 * i, 2);
          out[i] = bf16_to_f32(b);
        }
      } else {
        for (int64_t i = 0; i < n_in; ++i) out[i] = load_as_f32(row, data.dtype, i);
      }
      return;
    }
    case WeightFormat::kFp8Block: {
      const auto* row = reinterpret_cast<const uint8_t*>(data.data) + r * n_in;
      int64_t n_col_blocks = ceil_div(n_in, kFp8BlockSize);
      int64_t block_row = r / kFp8BlockSize;
      for (int64_t cb = 0; cb < n_col_blocks; ++cb) {
        float s = scale.get_f32(block_row * n_col_blocks + cb);
        int64_t end = std::min(n_in, (cb + 1) * kFp8BlockSize);
        for (int64_t i = cb * kFp8BlockSize; i < end; ++i) out[i] = f8e4m3_to_f32(row[i]) * s;
      }
      return;
    }
    case WeightFormat::kMxfp4: {
      const auto* row = reinterpret_cast<const uint8_t*>(data.data) + r * (n_in / 2);
      const auto* scales = reinterpret_cast<const uint8_t*>(scale.data) + r * (n_in / kMxfp4GroupSize);
      for (int64_t g = 0; g < n_in / kMxfp4GroupSize; ++g) {
        float s = e8m0_to_f32(scales[g]);
        for (int64_t j = 0; j < kMxfp4GroupSize / 2; ++j) {
          uint8_t byte = row[g * (kMxfp4GroupSize / 2) + j];
          out[g * kMxfp4GroupSize + 2 * j] = e2m1_to_f32(byte & 0xf) * s;
          out[g * kMxfp4GroupSize + 2 * j + 1] = e2m1_to_f32(byte >> 4) * s;
        }
      }
      return;
    }
  }
}

std::vector<float> QuantWeight::decode_all() const {
  std::vector<float> out(static_cast<size_t>(n_out * n_in));
  for (int64_t r = 0; r < n_out; ++r) decode_row(r, out.data() + r * n_in);
  return out;
}

QuantWeight QuantWeight::resolved() const {
  if (!deferred()) return *this;
  QuantWeight w = load_linear(*w4a16.source, name, n_out, n_in);
  BG_CHECK(w.format == format, "'{}': resolved as {}, bound as {}", name, weight_format_name(w.format),
           weight_format_name(format));
  w.w4a16 = w4a16;
  return w;
}

QuantWeight load_linear(const WeightSource& ckpt, const std::string& prefix, int64_t n_out, int64_t n_in) {
  QuantWeight w;
  w.n_out = n_out;
  w.n_in = n_in;
  w.name = prefix;
  if (auto packed = ckpt.find(prefix + ".weight_packed")) {
    std::string file = ckpt.file_of(packed->name);
    BG_CHECK(packed->dtype == DType::kU8, "tensor '{}' in {}: dtype {}: only MXFP4 (U8 E2M1 pairs) is supported for "
             "pack-quantized weights", packed->name, file, dtype_name(packed->dtype));
    BG_CHECK(n_in % kMxfp4GroupSize == 0, "'{}': input dim {} is not a multiple of 32", prefix, n_in);
    check_shape(*packed, {n_out, n_in / 2}, file);
    TensorView s = ckpt.get(prefix + ".weight_scale");
    check_dtype(s, DType::kU8, ckpt.file_of(s.name));
    check_shape(s, {n_out, n_in / kMxfp4GroupSize}, ckpt.file_of(s.name));
    w.format = WeightFormat::kMxfp4;
    w.data = *packed;
    w.scale = s;
    return w;
  }
  if (auto blocks = ckpt.find(prefix + ".weight_blocks")) {
    std::string file = ckpt.file_of(blocks->name);
    check_dtype(*blocks, DType::kU8, file);
    BG_CHECK(n_in % kMxfp4GroupSize == 0, "'{}': input dim {} is not a multiple of 32", prefix, n_in);
    check_shape(*blocks, {n_out, n_in / kMxfp4GroupSize, kMxfp4GroupSize / 2}, file);
    TensorView s = ckpt.get(prefix + ".weight_scales");
    check_dtype(s, DType::kU8, ckpt.file_of(s.name));
    check_shape(s, {n_out, n_in / kMxfp4GroupSize}, ckpt.file_of(s.name));
    w.format = WeightFormat::kMxfp4;
    w.data = *blocks;  // same bytes as [out, in/2]
    w.scale = s;
    return w;
  }
  TensorView t = ckpt.get(prefix + ".weight");
  std::string file = ckpt.file_of(t.name);
  check_shape(t, {n_out, n_in}, file);
  if (t.dtype == DType::kF8E4M3) {
    TensorView s = ckpt.get(prefix + ".weight_scale_inv");
    check_dtype(s, DType::kF32, ckpt.file_of(s.name));
    check_shape(s, {ceil_div(n_out, kFp8BlockSize), ceil_div(n_in, kFp8BlockSize)}, ckpt.file_of(s.name));
    w.format = WeightFormat::kFp8Block;
    w.data = t;
    w.scale = s;
    return w;
  }
  BG_CHECK(t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16,
           "tensor '{}' in {}: dtype {} is not a supported linear weight type (F32, BF16, F16, F8_E4M3 + "
           "weight_scale_inv, MXFP4)", t.name, file, dtype_name(t.dtype));
  w.format = WeightFormat::kDense;
  w.data = t;
  return w;
}

std::vector<std::string> linear_tensor_names(const std::string& prefix, WeightFormat format,
                                             bool mxfp4_packed_naming) {
  switch (format) {
    case WeightFormat::kDense: return {prefix + ".weight"};
    case WeightFormat::kFp8Block: return {prefix + ".weight", prefix + ".weight_scale_inv"};
    case WeightFormat::kMxfp4:
      if (mxfp4_packed_naming) return {prefix + ".weight_packed", prefix + ".weight_scale"};
      return {prefix + ".weight_blocks", prefix + ".weight_scales"};
  }
  return {};
}

void quantize_fp8_block(const float* w, int64_t n_out, int64_t n_in, HostTensor* codes, HostTensor* scale_inv) {
  int64_t rb = ceil_div(n_out, kFp8BlockSize), cb = ceil_div(n_in, kFp8BlockSize);
  *codes = HostTensor(DType::kF8E4M3, {n_out, n_in});
  *scale_inv = HostTensor(DType::kF32, {rb, cb});
  auto* c = reinterpret_cast<uint8_t*>(codes->data());
  auto* s = reinterpret_cast<float*>(scale_inv->data());
  for (int64_t bi = 0; bi < rb; ++bi) {
    for (int64_t bj = 0; bj < cb; ++bj) {
      int64_t r0 = bi * kFp8BlockSize, r1 = std::min(n_out, r0 + kFp8BlockSize);
      int64_t c0 = bj * kFp8BlockSize, c1 = std::min(n_in, c0 + kFp8BlockSize);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t k = c0; k < c1; ++k) amax = std::max(amax, std::fabs(w[r * n_in + k]));
      float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      s[bi * cb + bj] = scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t k = c0; k < c1; ++k) c[r * n_in + k] = f32_to_f8e4m3(w[r * n_in + k] / scale);
    }
  }
}

void quantize_mxfp4(const float* w, int64_t n_out, int64_t n_in, HostTensor* codes, HostTensor* scales) {
  BG_CHECK(n_in % kMxfp4GroupSize == 0, "quantize_mxfp4: input dim {} is not a multiple of 32", n_in);
  *codes = HostTensor(DType::kU8, {n_out, n_in / 2});
  *scales = HostTensor(DType::kU8, {n_out, n_in / kMxfp4GroupSize});
  auto* c = reinterpret_cast<uint8_t*>(codes->data());
  auto* s = reinterpret_cast<uint8_t*>(scales->data());
  for (int64_t r = 0; r < n_out; ++r) {
    for (int64_t g = 0; g < n_in / kMxfp4GroupSize; ++g) {
      const float* x = w + r * n_in + g * kMxfp4GroupSize;
      float amax = 0.0f;
      for (int64_t j = 0; j < kMxfp4GroupSize; ++j) amax = std::max(amax, std::fabs(x[j]));
      int e = amax > 0.0f ? static_cast<int>(std::floor(std::log2(amax))) - 2 : -127;
      e = std::clamp(e, -127, 127);
      s[r * (n_in / kMxfp4GroupSize) + g] = static_cast<uint8_t>(e + 127);
      float inv = std::ldexp(1.0f, -e);
      for (int64_t j = 0; j < kMxfp4GroupSize; j += 2) {
        uint8_t lo = f32_to_e2m1(x[j] * inv), hi = f32_to_e2m1(x[j + 1] * inv);
        c[r * (n_in / 2) + g * (kMxfp4GroupSize / 2) + j / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

}  // namespace bg
