// Tensor: a typed, shaped handle to memory owned by a backend (host memory for the CPU backend, device memory for
// CUDA). Copies share the storage; views (rows, reshape) keep the owner alive.
#pragma once

#include <cstdint>
#include <memory>

#include "core/dtype.h"
#include "core/tensor.h"

namespace bg {

enum class DeviceKind : uint8_t { kCpu, kCuda };

struct Tensor {
  std::shared_ptr<void> owner;  // keeps the allocation alive; null for borrowed memory
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  DeviceKind device = DeviceKind::kCpu;

  bool empty() const { return data == nullptr; }
  int64_t numel() const { return shape_numel(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size_bytes(dtype); }
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t cols() const { return rows() == 0 ? 0 : numel() / rows(); }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }

  // Rows [begin, begin + n) of the leading dim (contiguous storage).
  Tensor rows_view(int64_t begin, int64_t n) const;
  // Same storage, another shape of equal size.
  Tensor reshaped(Shape new_shape) const;
};

}  // namespace bg
