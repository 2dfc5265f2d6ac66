// Tensor views.
#include "backend/tensor.h"

#include "core/error.h"

namespace bg {

Tensor Tensor::rows_view(int64_t begin, int64_t n) const {
  BG_CHECK(begin >= 0 && n >= 0 && begin + n <= rows(), "rows_view [{}, {}) of a tensor with {} rows", begin,
           begin + n, rows());
  Tensor t = *this;
  t.shape[0] = n;
  t.data = static_cast<char*>(data) + static_cast<size_t>(begin * cols()) * dtype_size_bytes(dtype);
  return t;
}

Tensor Tensor::reshaped(Shape new_shape) const {
  BG_CHECK(shape_numel(new_shape) == numel(), "reshape {} -> {} changes the size", shape_str(shape),
           shape_str(new_shape));
  Tensor t = *this;
  t.shape = std::move(new_shape);
  return t;
}

}  // namespace bg
