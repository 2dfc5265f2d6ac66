// Linear-layer weights in their stored formats: dense (F32/BF16/F16), FP8 E4M3 with 128x128 block scales, and MXFP4
// (E2M1 codes, groups of 32 along the input dim, E8M0 scales) in both namings. Decoding is row by row, so callers
// never materialize a whole dequantized matrix.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/tensor.h"

namespace bg {

class WeightSource;

enum class WeightFormat : uint8_t {
  kDense,     // <p>.weight F32/BF16/F16 [out, in]
  kFp8Block,  // <p>.weight F8_E4M3 [out, in] + <p>.weight_scale_inv F32 [ceil(out/128), ceil(in/128)]
  kMxfp4,     // codes [out, in/2] bytes (low nibble = even element) + scales U8 [out, in/32]
};

std::string_view weight_format_name(WeightFormat format);

inline constexpr int64_t kFp8BlockSize = 128;
inline constexpr int64_t kMxfp4GroupSize = 32;

// A routed MXFP4 expert's projection that a weight store holds inside one W4A16 block (WeightSource::w4a16_expert)
// and that was bound without its checkpoint bytes (BindOptions::defer_w4a16_experts): the block the GPU expert kernel
// reads as it is, and the source that unpacks the checkpoint bytes for a consumer that needs them (resolved()).
struct W4a16BlockRef {
  std::span<const std::byte> block;  // the whole expert: gate/up then down, ops/moe_w4a16 layout `version`
  int64_t hidden = 0;
  int64_t inter = 0;
  uint32_t version = 0;
  const WeightSource* source = nullptr;  // outlives the weight (the model's weights keep it)
};

// A [out, in] linear weight in its stored format. Views point into the checkpoint (or a HostTensor).
struct QuantWeight {
  WeightFormat format = WeightFormat::kDense;
  int64_t n_out = 0;
  int64_t n_in = 0;
  TensorView data;   // dense values, fp8 codes, or mxfp4 packed codes (bytes, [out, in/2])
  TensorView scale;  // fp8: F32 [ceil(out/128), ceil(in/128)]; mxfp4: U8 [out, in/32]; dense: unused
  std::string name;  // checkpoint prefix, for messages
  // Set only for a deferred expert projection: then data and scale have their dtype, shape and size but no bytes
  // (data.data == nullptr) until resolved().
  W4a16BlockRef w4a16;

  bool deferred() const { return w4a16.source != nullptr && data.data == nullptr; }
  // This weight with its checkpoint bytes: itself, or for a deferred one the views the source unpacks (exactly the
  // checkpoint's bytes, checked against their checksums; they live as long as the source).
  QuantWeight resolved() const;

  // Writes row r (n_in values, fp32) of the dequantized matrix.
  void decode_row(int64_t r, float* out) const;
  // The whole matrix as fp32 [out, in] (tests, small weights).
  std::vector<float> decode_all() const;
};

// Finds the linear weight `<prefix>.weight` (or its quantized companions) in the checkpoint and checks it is
// [n_out, n_in]: dense `.weight`; FP8 `.weight` + `.weight_scale_inv`; MXFP4 `.weight_blocks` [out, in/32, 16] +
// `.weight_scales` [out, in/32]; compressed-tensors MXFP4 `.weight_packed` [out, in/2] + `.weight_scale`
// [out, in/32]. The format is decided by which tensors the file holds. Throws naming the tensor and file.
QuantWeight load_linear(const WeightSource& ckpt, const std::string& prefix, int64_t n_out, int64_t n_in);

// Names of every checkpoint tensor that load_linear would read for `prefix` in `format` (for the tensor table).
std::vector<std::string> linear_tensor_names(const std::string& prefix, WeightFormat format, bool mxfp4_packed_naming);

// Quantizers (make-random, tests): from fp32 [out, in] row-major.
// FP8: per 128x128 block, scale = amax/448 (1 if the block is all zero), codes = round(w/scale).
void quantize_fp8_block(const float* w, int64_t n_out, int64_t n_in, HostTensor* codes, HostTensor* scale_inv);
// MXFP4: per 32-group, scale exponent = floor(log2(amax)) - 2 (so amax maps into [4, 8) -> clipped to 6), codes
// nearest E2M1. `codes` is U8 [out, in/2].
void quantize_mxfp4(const float* w, int64_t n_out, int64_t n_in, HostTensor* codes, HostTensor* scales);

}  // namespace bg
