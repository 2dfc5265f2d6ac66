// Tensor views: rows, reshapes and the strided column views of a wider buffer (a fused group's parts), which only the
// ops that say so read (`strided_as`); `as` and `nbytes` refuse them.
#include "backend/tensor.h"

#include <gtest/gtest.h>

#include <vector>

#include "backend/backend.h"
#include "core/error.h"

namespace bg {
namespace {

Tensor host_tensor(std::vector<float>& v, Shape shape) {
  Tensor t;
  t.data = v.data();
  t.dtype = DType::kF32;
  t.shape = std::move(shape);
  return t;
}

TEST(Tensor, ColumnViewsAreStridedAndOnlyStridedReadersTakeThem) {
  std::vector<float> v(4 * 10);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  const Tensor all = host_tensor(v, {4, 10});
  EXPECT_TRUE(all.packed());
  EXPECT_EQ(all.ld(), 10);

  const Tensor mid = all.cols_view(3, 5);  // columns 3..7 of every row
  EXPECT_EQ(mid.shape, (Shape{4, 5}));
  EXPECT_FALSE(mid.packed());
  EXPECT_EQ(mid.ld(), 10);
  const float* p = mid.strided_as<float>();
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t c = 0; c < 5; ++c) EXPECT_EQ(p[r * mid.ld() + c], static_cast<float>(r * 10 + 3 + c));
  }
  EXPECT_THROW(mid.as<float>(), Error);  // an op assuming packed rows fails loudly
  EXPECT_THROW(static_cast<void>(mid.nbytes()), Error);
  EXPECT_THROW(mid.reshaped({20}), Error);
  EXPECT_THROW(mid.cols_view(0, 2), Error);  // views of views are not made

  // Rows of a strided view stay strided; one row is contiguous, so it is packed.
  const Tensor rows = mid.rows_view(1, 2);
  EXPECT_FALSE(rows.packed());
  EXPECT_EQ(rows.strided_as<float>()[rows.ld()], 23.0f);  // row 2, column 3
  const Tensor one = mid.rows_view(2, 1);
  EXPECT_TRUE(one.packed());
  EXPECT_EQ(one.as<float>()[4], 27.0f);
  EXPECT_EQ(one.nbytes(), 5 * sizeof(float));

  // All the columns: packed.
  EXPECT_TRUE(all.cols_view(0, 10).packed());
  EXPECT_THROW(all.cols_view(8, 3), Error);
  EXPECT_THROW(all.cols_view(-1, 2), Error);
  EXPECT_THROW(all.cols_view(0, 0), Error);
}

TEST(Tensor, TheCpuBackendRefusesStridedViewsItNeverMakes) {
  auto be = make_backend("cpu");
  Tensor all = be->alloc({3, 8}, DType::kF32);
  EXPECT_EQ(be->packed(all).data, all.data);  // packed: itself
  EXPECT_THROW(be->packed(all.cols_view(2, 4)), Error);
}

}  // namespace
}  // namespace bg
