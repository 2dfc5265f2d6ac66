// TensorView / HostTensor helpers.
#include "core/tensor.h"

#include <fmt/format.h>

namespace bg {

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

int64_t shape_numel(const Shape& shape) {
  constexpr int64_t kMax = int64_t{1} << 62;
  int64_t n = 1;
  for (int64_t d : shape) {
    BG_CHECK(d >= 0, "negative dimension in shape {}", shape_str(shape));
    BG_CHECK(d == 0 || n <= kMax / d, "shape {} is too large", shape_str(shape));
    n *= d;
  }
  return n;
}

int64_t TensorView::dim(int64_t i) const {
  BG_CHECK(i >= 0 && i < rank(), "tensor '{}' of shape {} has no dim {}", name, shape_str(shape), i);
  return shape[static_cast<size_t>(i)];
}

std::vector<float> TensorView::to_f32() const {
  int64_t n = numel();
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = get_f32(i);
  return out;
}

std::vector<int64_t> TensorView::to_i64() const {
  int64_t n = numel();
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    size_t k = static_cast<size_t>(i);
    switch (dtype) {
      case DType::kI64: std::memcpy(&out[k], data + k * 8, 8); break;
      case DType::kI32: { int32_t v; std::memcpy(&v, data + k * 4, 4); out[k] = v; break; }
      case DType::kU8: out[k] = static_cast<int64_t>(static_cast<uint8_t>(data[k])); break;
      default: fail("tensor '{}': expected an integer dtype, got {}", name, dtype_name(dtype));
    }
  }
  return out;
}

HostTensor::HostTensor(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)) {
  bytes_.resize(static_cast<size_t>(shape_numel(shape_)) * dtype_size_bytes(dtype_));
}

HostTensor HostTensor::from_f32(std::span<const float> values, Shape shape) {
  HostTensor t(DType::kF32, std::move(shape));
  BG_CHECK(values.size() == static_cast<size_t>(shape_numel(t.shape_)), "from_f32: {} values for shape {}",
           values.size(), shape_str(t.shape_));
  std::memcpy(t.data(), values.data(), t.nbytes());
  return t;
}

HostTensor HostTensor::from_i64(std::span<const int64_t> values, Shape shape) {
  HostTensor t(DType::kI64, std::move(shape));
  BG_CHECK(values.size() == static_cast<size_t>(shape_numel(t.shape_)), "from_i64: {} values for shape {}",
           values.size(), shape_str(t.shape_));
  std::memcpy(t.data(), values.data(), t.nbytes());
  return t;
}

TensorView HostTensor::view(std::string name) const {
  return TensorView{dtype_, shape_, bytes_.data(), bytes_.size(), std::move(name)};
}

}  // namespace bg
