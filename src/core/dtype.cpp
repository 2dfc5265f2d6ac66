// Scalar conversions between storage dtypes and fp32.
#include "core/dtype.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace bg {
namespace {

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  size_t size_bytes;
};

constexpr std::array<DTypeEntry, 15> kDTypes = {{
    {DType::kF64, "F64", 8},
    {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E8M0, "F8_E8M0", 1},
    {DType::kBool, "BOOL", 1},
    {DType::kU8, "U8", 1},
    {DType::kI8, "I8", 1},
    {DType::kI16, "I16", 2},
    {DType::kU16, "U16", 2},
    {DType::kI32, "I32", 4},
    {DType::kU32, "U32", 4},
    {DType::kI64, "I64", 8},
    {DType::kU64, "U64", 8},
}};

constexpr std::array<float, 8> kE2M1Magnitudes = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

template <typename T>
T load(const std::byte* data, int64_t i) {
  T v;
  std::memcpy(&v, data + static_cast<size_t>(i) * sizeof(T), sizeof(T));
  return v;
}

}  // namespace

std::string_view dtype_name(DType dtype) {
  for (const auto& e : kDTypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& e : kDTypes) {
    if (e.name == name) return e.dtype;
  }
  return std::nullopt;
}

size_t dtype_size_bytes(DType dtype) {
  for (const auto& e : kDTypes) {
    if (e.dtype == dtype) return e.size_bytes;
  }
  return 0;
}

float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t f32_to_bf16(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((u >> 16) | 0x40);
  uint32_t rounding = 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

float f16_to_f32(uint16_t bits) {
  uint32_t sign = (bits >> 15) & 1;
  uint32_t exp = (bits >> 10) & 0x1f;
  uint32_t mant = bits & 0x3ff;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    mag = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    mag = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -mag : mag;
}

float f8e4m3_to_f32(uint8_t bits) {
  uint32_t sign = bits >> 7;
  uint32_t exp = (bits >> 3) & 0xf;
  uint32_t mant = bits & 0x7;
  float mag;
  if (exp == 0xf && mant == 0x7) {
    mag = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    mag = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant/8 * 2^-6
  } else {
    mag = std::ldexp(static_cast<float>(mant | 0x8), static_cast<int>(exp) - 10);  // (1+m/8) * 2^(e-7)
  }
  return sign ? -mag : mag;
}

uint8_t f32_to_f8e4m3(float value) {
  if (std::isnan(value)) return 0x7f;
  uint8_t sign = std::signbit(value) ? 0x80 : 0;
  float mag = std::fabs(value);
  if (mag >= 448.0f) return static_cast<uint8_t>(sign | 0x7e);
  if (mag < std::ldexp(1.0f, -6)) {
    // Subnormal range: multiples of 2^-9, rounded to nearest even (8 * 2^-9 is the smallest normal, code 0x08).
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(mag * 512.0f)));
  }
  int exp = 0;
  float frac = std::frexp(mag, &exp);  // mag = frac * 2^exp, frac in [0.5, 1)
  int e = exp - 1;                     // mag = (2 * frac) * 2^e, 2 * frac in [1, 2)
  int mant = static_cast<int>(std::nearbyint((2.0f * frac - 1.0f) * 8.0f));  // ties to even
  if (mant == 8) {
    mant = 0;
    ++e;
  }
  return static_cast<uint8_t>(sign | ((e + 7) << 3) | mant);
}

float e2m1_to_f32(uint8_t code) {
  float mag = kE2M1Magnitudes[code & 0x7];
  return (code & 0x8) ? -mag : mag;
}

uint8_t f32_to_e2m1(float value) {
  uint8_t sign = std::signbit(value) ? 0x8 : 0;
  float mag = std::fabs(value);
  if (std::isnan(value)) return 0;
  if (mag <= 6.0f) {
    // Nearest code by the midpoints of the magnitudes, a tie going to the even code (">" keeps the lower code, ">="
    // takes the upper): the same result as the search below, whose differences are exact in this range, without it
    // (make-random quantizes billions of expert weights).
    const int code = (mag > 0.25f) + (mag >= 0.75f) + (mag > 1.25f) + (mag >= 1.75f) + (mag > 2.5f) + (mag >= 3.5f) +
                     (mag > 5.0f);
    return static_cast<uint8_t>(sign | code);
  }
  uint8_t best = 0;
  float best_err = std::numeric_limits<float>::infinity();
  for (uint8_t code = 0; code < 8; ++code) {
    float err = std::fabs(kE2M1Magnitudes[code] - mag);
    if (err < best_err || (err == best_err && (code & 1) == 0)) {
      best = code;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

float e8m0_to_f32(uint8_t bits) {
  if (bits == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(bits) - 127);
}

float load_as_f32(const std::byte* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF64: return static_cast<float>(load<double>(data, i));
    case DType::kF32: return load<float>(data, i);
    case DType::kF16: return f16_to_f32(load<uint16_t>(data, i));
    case DType::kBF16: return bf16_to_f32(load<uint16_t>(data, i));
    case DType::kF8E4M3: return f8e4m3_to_f32(load<uint8_t>(data, i));
    case DType::kF8E8M0: return e8m0_to_f32(load<uint8_t>(data, i));
    case DType::kBool:
    case DType::kU8: return static_cast<float>(load<uint8_t>(data, i));
    case DType::kI8: return static_cast<float>(load<int8_t>(data, i));
    case DType::kI16: return static_cast<float>(load<int16_t>(data, i));
    case DType::kU16: return static_cast<float>(load<uint16_t>(data, i));
    case DType::kI32: return static_cast<float>(load<int32_t>(data, i));
    case DType::kU32: return static_cast<float>(load<uint32_t>(data, i));
    case DType::kI64: return static_cast<float>(load<int64_t>(data, i));
    case DType::kU64: return static_cast<float>(load<uint64_t>(data, i));
  }
  fail("load_as_f32: unhandled dtype {}", static_cast<int>(dtype));
}

}  // namespace bg
