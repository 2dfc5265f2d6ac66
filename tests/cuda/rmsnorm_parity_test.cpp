// CUDA RMSNorm against rmsnorm_cpu on bf16-rounded inputs: real widths (7168 hidden, 1536 / 512 latents, 128 heads),
// ragged row counts, in place, and a strided slice of MLA's [n, 576] latent whose tail must stay untouched.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/small_ops_testing.h"
#include "ops/rmsnorm/rmsnorm_cuda.h"

namespace bg::testing {
namespace {

std::vector<float> weights(int64_t dim, uint64_t seed) {
  std::vector<float> w = random_floats(static_cast<size_t>(dim), 0.3f, seed);
  for (auto& v : w) v += 1.0f;
  return w;
}

TEST(RmsNormParity, ContiguousAndInPlace) {
  BG_REQUIRE_GPU();
  for (int64_t dim : {9000, 7168, 3584, 1536, 512, 200, 128, 33, 1}) {  // every register tier and past them
    for (int64_t n_rows : {1, 3, 17, 128, 1000}) {
      if (dim == 7168 && n_rows == 1000) continue;  // 128 rows already cover the block-per-row path at this width
      SCOPED_TRACE(::testing::Message() << "rows " << n_rows << " dim " << dim);
      const size_t n = static_cast<size_t>(n_rows * dim);
      std::vector<float> x = random_floats(n, 2.0f, static_cast<uint64_t>(dim + n_rows));
      for (size_t i = 0; i < n; ++i) x[i] *= static_cast<float>(1 + i % 7);  // rows of different scales
      const std::vector<float> w = weights(dim, 5);
      const cuda::DeviceBuffer d_x = upload_bf16(x), d_w = cuda::upload(w);
      const ops::RmsNormParams p{n_rows, dim, 1e-6f};
      std::vector<float> ref(n);
      ops::rmsnorm_cpu(p, x.data(), w.data(), ref.data());

      cuda::DeviceBuffer y = poisoned(n * 2);
      ops::rmsnorm_cuda(p, bf16_ptr(d_x), d_w.as<float>(), bf16_ptr(y), nullptr);
      sync_device();
      EXPECT_LE(max_rel_error(download_bf16(y, n), ref), kTolBf16Out);

      ops::rmsnorm_cuda(p, bf16_ptr(d_x), d_w.as<float>(), bf16_ptr(d_x), nullptr);  // in place
      sync_device();
      EXPECT_EQ(first_mismatch(download_bf16(d_x, n), download_bf16(y, n)), -1);
    }
  }
}

TEST(RmsNormParity, StridedSliceInPlace) {
  BG_REQUIRE_GPU();
  const int64_t entry = 576, rank = 512;  // MLA latent entry: [c_kv (512) | k_pe (64)]; the norm covers c_kv
  for (int64_t n_rows : {1, 17, 128}) {
    const size_t n = static_cast<size_t>(n_rows * entry);
    std::vector<float> x = random_floats(n, 1.5f, 21);
    const std::vector<float> w = weights(rank, 22);
    cuda::DeviceBuffer d_x = upload_bf16(x);
    const cuda::DeviceBuffer d_w = cuda::upload(w);
    std::vector<float> want = x;
    for (int64_t r = 0; r < n_rows; ++r) {
      float* row = want.data() + r * entry;
      ops::rmsnorm_cpu({1, rank, 1e-6f}, row, w.data(), row);
      for (int64_t i = 0; i < rank; ++i) row[i] = bf16_to_f32(f32_to_bf16(row[i]));
    }
    ops::rmsnorm_cuda({n_rows, rank, 1e-6f}, {entry, entry}, bf16_ptr(d_x), d_w.as<float>(), bf16_ptr(d_x), nullptr);
    sync_device();
    const std::vector<float> got = download_bf16(d_x, n);
    EXPECT_LE(max_rel_error(got, want), kTolBf16Out) << "rows " << n_rows;
    for (int64_t r = 0; r < n_rows; ++r) {
      for (int64_t i = rank; i < entry; ++i) {
        ASSERT_EQ(got[static_cast<size_t>(r * entry + i)], x[static_cast<size_t>(r * entry + i)]) << r << " " << i;
      }
    }
    // Out of place into a contiguous [n, 512] buffer.
    cuda::DeviceBuffer d_src = upload_bf16(x), y = poisoned(static_cast<size_t>(n_rows * rank) * 2);
    ops::rmsnorm_cuda({n_rows, rank, 1e-6f}, {entry, 0}, bf16_ptr(d_src), d_w.as<float>(), bf16_ptr(y), nullptr);
    sync_device();
    const std::vector<float> packed = download_bf16(y, static_cast<size_t>(n_rows * rank));
    for (int64_t r = 0; r < n_rows; ++r) {
      for (int64_t i = 0; i < rank; ++i) {
        ASSERT_EQ(packed[static_cast<size_t>(r * rank + i)], got[static_cast<size_t>(r * entry + i)]) << r << " " << i;
      }
    }
  }
}

TEST(RmsNormParity, RejectsBadShapes) {
  BG_REQUIRE_GPU();
  cuda::DeviceBuffer b(64);
  EXPECT_THROW(ops::rmsnorm_cuda({1, 0, 1e-6f}, bf16_ptr(b), b.as<float>(), bf16_ptr(b), nullptr), Error);
  EXPECT_THROW(ops::rmsnorm_cuda({2, 8, 1e-6f}, {4, 8}, bf16_ptr(b), b.as<float>(), bf16_ptr(b), nullptr), Error);
  EXPECT_THROW(ops::rmsnorm_cuda({2, 8, 1e-6f}, {8, 16}, bf16_ptr(b), b.as<float>(), bf16_ptr(b), nullptr), Error);
  EXPECT_NO_THROW(ops::rmsnorm_cuda({0, 8, 1e-6f}, nullptr, nullptr, nullptr, nullptr));
}

}  // namespace
}  // namespace bg::testing
