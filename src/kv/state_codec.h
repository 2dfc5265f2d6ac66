// How offloaded KDA recurrent state is stored in the host tier: exact fp32 (the default), bf16, or FP8 e4m3 with one
// fp32 scale per row of `row_floats` values (a row of a head's recurrent state [K, V] is V values). The conv states
// are stored as they are in every mode (kv/state_offload.cpp). Error against the fp32 state,
// per value x of a row with largest magnitude m (tested in tests/kv/state_codec_test.cpp):
//   f32:  exact;
//   bf16: |x' - x| <= 2^-8 |x| (round to nearest even, 7 stored mantissa bits);
//   fp8:  |x' - x| <= 2^-4 |x| + 2^-10 m (3 mantissa bits on x / s with s = m / 448; e4m3 subnormals below 2^-6 are
//         spaced 2^-9 apart).
// Lossy modes make outputs after a restore differ from outputs without offloading.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace bg::kv {

enum class StateCodec : uint8_t { kF32, kBF16, kFP8 };

// "f32" | "bf16" | "fp8"; anything else is a bg::Error naming the choices.
StateCodec parse_state_codec(const std::string& name);
const char* state_codec_name(StateCodec codec);

// Bytes of n floats (a multiple of row_floats) once encoded.
int64_t encoded_bytes(StateCodec codec, int64_t n_floats, int64_t row_floats);
void encode_state(StateCodec codec, std::span<const float> x, int64_t row_floats, std::span<std::byte> out);
void decode_state(StateCodec codec, std::span<const std::byte> in, int64_t row_floats, std::span<float> x);

}  // namespace bg::kv
