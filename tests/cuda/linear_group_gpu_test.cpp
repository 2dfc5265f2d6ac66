// Fused linear groups on the CUDA backend (backend/cuda/cuda_linears.h): a run of dense weights with one n_in is
// uploaded back to back and gets one fused handle; linear_group gives each part's output from one GEMM (views at one
// row, the split kernel above), part by part past kLinearGroupMaxFusedRows or where the run cannot fuse. Every
// output is checked against linear_cpu on the same bf16 inputs; the split kernel against split_columns_cpu.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_linears.h"
#include "backend/cuda/cuda_moe.h"
#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/linear/linear.h"

namespace bg {
namespace {

struct Part {
  WeightFormat format;
  int64_t n_out, n_in;
};

// Prepares `parts` as one run on a fresh CUDA backend and checks linear_group against linear_cpu at each row count.
// strided: the caller reads strided parts (LinearGroup::strided_parts), so fused parts are the GEMM output's columns.
void check_group(const std::vector<Part>& parts, bool expect_fused, const std::vector<int64_t>& rows,
                 bool strided = false) {
  std::unique_ptr<Backend> be = make_cuda_backend();
  std::vector<testing::HostWeight> host;
  LinearBatch batch;
  for (size_t i = 0; i < parts.size(); ++i) {
    host.push_back(testing::random_weight(parts[i].format, parts[i].n_out, parts[i].n_in,
                                          1.0f / std::sqrt(static_cast<float>(parts[i].n_in)), 100 + i));
  }
  for (const auto& h : host) batch.weights.push_back(&h.w);
  batch.runs.push_back({0, parts.size()});
  PreparedLinears prepared = be->prepare_linears(batch);
  ASSERT_EQ(prepared.weights.size(), parts.size());
  ASSERT_EQ(prepared.runs.size(), 1u);
  ASSERT_EQ(prepared.runs[0] != nullptr, expect_fused);
  LinearGroup g;
  for (const auto& w : prepared.weights) g.parts.push_back(w.get());
  g.fused = prepared.runs[0].get();
  g.strided_parts = strided;
  if (g.fused != nullptr) {
    // The parts' rows follow each other inside the fused weight.
    const ops::DeviceWeight& fused = cuda::cuda_linear(*g.fused).desc();
    int64_t row = 0;
    for (const LinearHandle* p : g.parts) {
      EXPECT_EQ(cuda::cuda_linear(*p).desc().data,
                static_cast<const __nv_bfloat16*>(fused.data) + row * fused.n_in);
      row += p->n_out();
    }
    EXPECT_EQ(fused.n_out, row);
  }
  const int64_t n_in = parts.front().n_in;
  for (int64_t n : rows) {
    SCOPED_TRACE(fmt::format("{} rows", n));
    EXPECT_EQ(be->linear_group_fuses(g, n), expect_fused && n <= cuda::kLinearGroupMaxFusedRows);
    std::vector<float> x = testing::random_floats(static_cast<size_t>(n * n_in), 1.0f, 7 + static_cast<uint64_t>(n));
    testing::to_bf16(x);
    const Tensor dx = be->upload_f32(x, {n, n_in}, DType::kBF16);
    const std::vector<Tensor> ys = be->linear_group(g, dx);
    ASSERT_EQ(ys.size(), parts.size());
    const bool views = strided && be->linear_group_fuses(g, n) && n > 1;
    int64_t col = 0;  // views: part i's columns of one [n, sum of n_out] output, side by side
    for (size_t i = 0; i < parts.size(); ++i) {
      ASSERT_EQ(ys[i].shape, (Shape{n, parts[i].n_out}));
      EXPECT_EQ(ys[i].packed(), !views);
      if (views) {
        EXPECT_EQ(ys[i].ld(), cuda::cuda_linear(*g.fused).desc().n_out);
        EXPECT_EQ(ys[i].strided_as<__nv_bfloat16>(), ys[0].strided_as<__nv_bfloat16>() + col);
      }
      col += parts[i].n_out;
      std::vector<float> got(static_cast<size_t>(n * parts[i].n_out)), ref(got.size());
      be->download_f32(be->packed(ys[i]), got.data());
      ops::linear_cpu(host[i].w, x.data(), n, ref.data());
      testing::expect_parity(got, ref, testing::kTolBf16Out, fmt::format("part {}", i));
    }
  }
}

TEST(LinearGroupCuda, KimiK3KdaProjectionsFuse) {
  BG_REQUIRE_GPU();
  // q, k, v, g (4 x 96 heads x 128), f_a (128), b (96 heads) of a 7168-wide input: one run of 49,376 rows.
  check_group({{WeightFormat::kDense, 12288, 7168},
               {WeightFormat::kDense, 12288, 7168},
               {WeightFormat::kDense, 12288, 7168},
               {WeightFormat::kDense, 12288, 7168},
               {WeightFormat::kDense, 128, 7168},
               {WeightFormat::kDense, 96, 7168}},
              true, {1, 5, 64, 65});
}

// LinearGroup::strided_parts: the parts are the fused output's columns (no split launch); packed copies of them
// (Backend::packed) hold the parts' products.
TEST(LinearGroupCuda, StridedPartsAreTheFusedOutputsColumns) {
  BG_REQUIRE_GPU();
  check_group({{WeightFormat::kDense, 384, 1024}, {WeightFormat::kDense, 128, 1024}, {WeightFormat::kDense, 96, 1024}},
              true, {1, 5, 64, 65}, true);
  check_group({{WeightFormat::kDense, 3, 8}, {WeightFormat::kDense, 13, 8}}, true, {2, 17}, true);
}

TEST(LinearGroupCuda, OddWidthsUseTheScalarSplit) {
  BG_REQUIRE_GPU();
  // Widths that are not multiples of 8 (the split copies element by element) and an n_in of 8 (rows 16 B apart).
  check_group({{WeightFormat::kDense, 3, 8}, {WeightFormat::kDense, 13, 8}, {WeightFormat::kDense, 1, 8}}, true,
              {1, 2, 17, 64, 100});
}

TEST(LinearGroupCuda, QuantizedOrMismatchedRunsRunPartByPart) {
  BG_REQUIRE_GPU();
  check_group({{WeightFormat::kDense, 256, 512}, {WeightFormat::kFp8Block, 256, 512}}, false, {1, 4});
  check_group({{WeightFormat::kDense, 64, 512}, {WeightFormat::kDense, 64, 256}}, false, {1, 3});
  check_group({{WeightFormat::kDense, 64, 100}, {WeightFormat::kDense, 64, 100}}, false, {2});  // rows not 16 B
  check_group({{WeightFormat::kDense, 64, 512}}, false, {1});
}

TEST(SplitColumnsCuda, MatchesTheCpuReference) {
  BG_REQUIRE_GPU();
  struct Case {
    int64_t rows, cols;
    std::vector<std::pair<int64_t, int64_t>> slices;  // col0, cols
  };
  const std::vector<Case> cases = {{3, 64, {{0, 16}, {16, 40}, {56, 8}}},        // 16-byte copies
                                   {70000, 24, {{8, 16}, {0, 8}}},                // more rows than grid.y
                                   {5, 37, {{0, 5}, {5, 31}, {36, 1}, {2, 0}}},   // element copies, an empty slice
                                   {0, 16, {{0, 16}}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("[{}, {}]", c.rows, c.cols));
    std::vector<float> src = testing::random_floats(static_cast<size_t>(c.rows * c.cols), 1.0f, 3);
    const std::vector<uint16_t> bits = testing::to_bf16(src);
    cuda::DeviceBuffer dsrc = cuda::upload(bits);
    std::vector<cuda::DeviceBuffer> ddst;
    std::vector<std::vector<float>> ref;
    std::vector<ops::ColumnSlice> dev_slices, cpu_slices;
    for (const auto& [c0, w] : c.slices) {
      ddst.emplace_back(static_cast<size_t>(std::max<int64_t>(c.rows * w, 1)) * 2);
      ddst.back().fill_bytes(0xff);
      ref.emplace_back(static_cast<size_t>(c.rows * w));
      dev_slices.push_back({c0, w, ddst.back().data()});
      cpu_slices.push_back({c0, w, ref.back().data()});
    }
    ops::split_columns_cuda(c.rows, dsrc.as<__nv_bfloat16>(), c.cols, dev_slices, nullptr);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    ops::split_columns_cpu(c.rows, src.data(), c.cols, cpu_slices);
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_EQ(testing::from_bf16(cuda::download<uint16_t>(ddst[i], ref[i].size())), ref[i]) << "slice " << i;
    }
  }
  cuda::DeviceBuffer d(64);
  const ops::ColumnSlice outside{10, 8, d.data()};
  EXPECT_THROW(ops::split_columns_cuda(1, d.as<__nv_bfloat16>(), 16, {&outside, 1}, nullptr), Error);
}

}  // namespace
}  // namespace bg
