// Element types of checkpoints and activations, their safetensors names, sizes and scalar conversions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace bg {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,  // float8_e4m3fn: no Inf, 0x7f/0xff are NaN, max 448
  kF8E8M0,  // E8M0 scale exponent (also stored as U8 in MXFP4 checkpoints)
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kI32,
  kU32,
  kI64,
  kU64,
};

// Safetensors dtype string ("F32", "BF16", "F8_E4M3", ...).
std::string_view dtype_name(DType dtype);
// Parses a safetensors dtype string; nullopt for names batchgen does not handle.
std::optional<DType> dtype_from_name(std::string_view name);
size_t dtype_size_bytes(DType dtype);

float bf16_to_f32(uint16_t bits);
// Round to nearest even; NaN stays NaN.
uint16_t f32_to_bf16(float value);
float f16_to_f32(uint16_t bits);
float f8e4m3_to_f32(uint8_t bits);
// Round to nearest even, saturating to +-448 (the DeepSeek quantizer's convention); NaN -> 0x7f.
uint8_t f32_to_f8e4m3(float value);

// MXFP4 element: E2M1 code (bit 3 = sign) -> {0, .5, 1, 1.5, 2, 3, 4, 6} with sign.
float e2m1_to_f32(uint8_t code);
// Nearest E2M1 code (ties to even mantissa), saturating to +-6.
uint8_t f32_to_e2m1(float value);
// MXFP4 / E8M0 scale: 2^(bits - 127); 0xff is NaN.
float e8m0_to_f32(uint8_t bits);

// Reads element i of a buffer of `dtype` as float (floating types and integer types).
float load_as_f32(const std::byte* data, DType dtype, int64_t i);

}  // namespace bg
