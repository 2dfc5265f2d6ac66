// Tensor views.
#include "backend/tensor.h"

#include "core/error.h"

namespace bg {

size_t Tensor::nbytes() const {
  if (!packed()) refuse_strided();
  return static_cast<size_t>(numel()) * dtype_size_bytes(dtype);
}

void Tensor::refuse_strided() const {
  fail("internal: a strided view [{}] (rows {} elements apart) reached an op that needs packed rows", shape_str(shape),
       row_stride);
}

Tensor Tensor::rows_view(int64_t begin, int64_t n) const {
  BG_CHECK(begin >= 0 && n >= 0 && begin + n <= rows(), "rows_view [{}, {}) of a tensor with {} rows", begin,
           begin + n, rows());
  Tensor t = *this;
  const int64_t step = ld();
  t.shape[0] = n;
  t.data = static_cast<char*>(data) + static_cast<size_t>(begin * step) * dtype_size_bytes(dtype);
  return t;
}

Tensor Tensor::cols_view(int64_t col0, int64_t n) const {
  BG_CHECK(shape.size() == 2 && packed(), "cols_view of a {} tensor{}", shape_str(shape),
           packed() ? "" : " that is already strided");
  BG_CHECK(col0 >= 0 && n > 0 && col0 + n <= cols(), "cols_view [{}, {}) of a tensor with {} columns", col0, col0 + n,
           cols());
  Tensor t = *this;
  t.shape = {rows(), n};
  t.row_stride = n == cols() ? 0 : cols();
  t.data = static_cast<char*>(data) + static_cast<size_t>(col0) * dtype_size_bytes(dtype);
  return t;
}

Tensor Tensor::reshaped(Shape new_shape) const {
  if (!packed()) refuse_strided();
  BG_CHECK(shape_numel(new_shape) == numel(), "reshape {} -> {} changes the size", shape_str(shape),
           shape_str(new_shape));
  Tensor t = *this;
  t.shape = std::move(new_shape);
  return t;
}

}  // namespace bg
