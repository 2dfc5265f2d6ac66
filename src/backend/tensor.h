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
  // A 2-D view of some columns of a wider buffer (cols_view): elements from one row to the next; 0 when the rows are
  // packed. Only ops that say so read a strided view (through strided_as and ld); `as` refuses one, so an op that
  // assumes packed rows fails loudly instead of reading the wrong elements.
  int64_t row_stride = 0;

  bool empty() const { return data == nullptr; }
  int64_t numel() const { return shape_numel(shape); }
  // The bytes of a packed tensor (refused for a strided view).
  size_t nbytes() const;
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t cols() const { return rows() == 0 ? 0 : numel() / rows(); }
  bool packed() const { return row_stride == 0 || row_stride == cols() || rows() <= 1; }
  // Elements from one row to the next.
  int64_t ld() const { return row_stride == 0 ? cols() : row_stride; }
  template <typename T>
  T* as() const {
    if (!packed()) refuse_strided();
    return static_cast<T*>(data);
  }
  // The first element of a packed or strided tensor; row r starts ld() elements after row r - 1.
  template <typename T>
  T* strided_as() const { return static_cast<T*>(data); }

  // Rows [begin, begin + n) of the leading dim (a strided view stays strided).
  Tensor rows_view(int64_t begin, int64_t n) const;
  // Columns [col0, col0 + n) of every row of a packed 2-D tensor: a strided view (row_stride = cols()).
  Tensor cols_view(int64_t col0, int64_t n) const;
  // Same storage, another shape of equal size (packed tensors only).
  Tensor reshaped(Shape new_shape) const;

 private:
  [[noreturn]] void refuse_strided() const;
};

}  // namespace bg
