// State codecs: f32 copy, bf16 round to nearest even, FP8 e4m3 with a per-row absmax scale.
#include "kv/state_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"

namespace bg::kv {
namespace {

constexpr float kFp8Max = 448.0f;

void check_rows(int64_t n_floats, int64_t row_floats) {
  BG_CHECK(row_floats > 0 && n_floats % row_floats == 0, "state codec: {} values are not whole rows of {}", n_floats,
           row_floats);
}

}  // namespace

StateCodec parse_state_codec(const std::string& name) {
  if (name == "f32") return StateCodec::kF32;
  if (name == "bf16") return StateCodec::kBF16;
  if (name == "fp8") return StateCodec::kFP8;
  fail("state offload dtype '{}' must be f32 (exact), bf16 or fp8", name);
}

const char* state_codec_name(StateCodec codec) {
  switch (codec) {
    case StateCodec::kF32: return "f32";
    case StateCodec::kBF16: return "bf16";
    case StateCodec::kFP8: return "fp8";
  }
  return "?";
}

int64_t encoded_bytes(StateCodec codec, int64_t n_floats, int64_t row_floats) {
  check_rows(n_floats, row_floats);
  switch (codec) {
    case StateCodec::kF32: return n_floats * 4;
    case StateCodec::kBF16: return n_floats * 2;
    case StateCodec::kFP8: return n_floats + n_floats / row_floats * 4;  // codes, then one fp32 scale per row
  }
  return 0;
}

void encode_state(StateCodec codec, std::span<const float> x, int64_t row_floats, std::span<std::byte> out) {
  const auto n = static_cast<int64_t>(x.size());
  BG_CHECK(static_cast<int64_t>(out.size()) == encoded_bytes(codec, n, row_floats), "state codec: {} bytes for {} "
           "values", out.size(), n);
  if (codec == StateCodec::kF32) {
    std::memcpy(out.data(), x.data(), out.size());
  } else if (codec == StateCodec::kBF16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t b = f32_to_bf16(x[static_cast<size_t>(i)]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  } else {
    std::byte* scales = out.data() + n;
    for (int64_t r = 0; r < n / row_floats; ++r) {
      const float* row = x.data() + r * row_floats;
      float m = 0.0f;
      for (int64_t i = 0; i < row_floats; ++i) m = std::max(m, std::fabs(row[i]));
      const float scale = m > 0.0f ? m / kFp8Max : 1.0f;
      std::memcpy(scales + 4 * r, &scale, 4);
      for (int64_t i = 0; i < row_floats; ++i) {
        out[static_cast<size_t>(r * row_floats + i)] = static_cast<std::byte>(f32_to_f8e4m3(row[i] / scale));
      }
    }
  }
}

void decode_state(StateCodec codec, std::span<const std::byte> in, int64_t row_floats, std::span<float> x) {
  const auto n = static_cast<int64_t>(x.size());
  BG_CHECK(static_cast<int64_t>(in.size()) == encoded_bytes(codec, n, row_floats), "state codec: {} bytes for {} "
           "values", in.size(), n);
  if (codec == StateCodec::kF32) {
    std::memcpy(x.data(), in.data(), in.size());
  } else if (codec == StateCodec::kBF16) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t b = 0;
      std::memcpy(&b, in.data() + 2 * i, 2);
      x[static_cast<size_t>(i)] = bf16_to_f32(b);
    }
  } else {
    const std::byte* scales = in.data() + n;
    for (int64_t r = 0; r < n / row_floats; ++r) {
      float scale = 0.0f;
      std::memcpy(&scale, scales + 4 * r, 4);
      for (int64_t i = 0; i < row_floats; ++i) {
        const auto idx = static_cast<size_t>(r * row_floats + i);
        x[idx] = f8e4m3_to_f32(static_cast<uint8_t>(in[idx])) * scale;
      }
    }
  }
}

}  // namespace bg::kv
