// Helpers shared by the MoE layer tests: host vectors in and out of backend tensors.
#pragma once

#include <span>
#include <vector>

#include "backend/backend.h"

namespace bg::moe {

inline Tensor upload_i32(Backend& be, const std::vector<int32_t>& v, Shape shape) {
  Tensor t = be.alloc(std::move(shape), DType::kI32);
  if (!v.empty()) be.write_bytes(t, std::as_bytes(std::span<const int32_t>(v)));  // a rank without tokens
  return t;
}

inline std::vector<float> download(Backend& be, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  be.download_f32(t, v.data());
  return v;
}

}  // namespace bg::moe
