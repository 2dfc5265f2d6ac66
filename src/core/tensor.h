// Tensor views (non-owning: mmap'd checkpoint bytes, pools) and HostTensor (owning host bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace bg {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);
// Product of dims; throws on negative dims or overflow past 2^62.
int64_t shape_numel(const Shape& shape);

// A read-only view of C-order bytes. `name` says where it came from (for error messages).
struct TensorView {
  DType dtype = DType::kF32;
  Shape shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;
  std::string name;

  int64_t numel() const { return shape_numel(shape); }
  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  int64_t dim(int64_t i) const;
  // Element i as float (memcpy load: checkpoint data may be unaligned).
  float get_f32(int64_t i) const { return load_as_f32(data, dtype, i); }
  // Whole tensor converted to fp32.
  std::vector<float> to_f32() const;
  // Integer tensors (I32/I64/U8...) as int64.
  std::vector<int64_t> to_i64() const;
};

// Owning host tensor (activations written to files, random checkpoints, test data).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, Shape shape);
  static HostTensor from_f32(std::span<const float> values, Shape shape);
  static HostTensor from_i64(std::span<const int64_t> values, Shape shape);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  std::byte* data() { return bytes_.data(); }
  const std::byte* data() const { return bytes_.data(); }
  size_t nbytes() const { return bytes_.size(); }
  TensorView view(std::string name = {}) const;

 private:
  DType dtype_ = DType::kF32;
  Shape shape_;
  std::vector<std::byte> bytes_;
};

}  // namespace bg
