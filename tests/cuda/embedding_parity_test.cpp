// CUDA embedding against embedding_cpu: bf16 and fp32 tables, real hidden size and vocabulary, and out-of-range ids
// (NaN rows and the error flag, never an out-of-bounds read).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/tensor.h"
#include "cuda/small_ops_testing.h"
#include "ops/embedding/embedding_cuda.h"
#include "ops/linear/linear.h"

namespace bg::testing {
namespace {

using ops::EmbeddingParams;

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = dist(rng);
  ids.front() = 0;
  if (n > 1) ids.back() = static_cast<int32_t>(vocab - 1);
  return ids;
}

TensorView view_of(const void* data, DType dtype, int64_t vocab, int64_t dim) {
  TensorView v;
  v.dtype = dtype;
  v.shape = {vocab, dim};
  v.data = static_cast<const std::byte*>(data);
  v.nbytes = static_cast<size_t>(vocab * dim) * dtype_size_bytes(dtype);
  v.name = "embed";
  return v;
}

struct Shape {
  int64_t vocab, dim, n_tokens;
};

TEST(EmbeddingParity, Bf16AndF32TablesMatchCpuExactly) {
  BG_REQUIRE_GPU();
  const Shape shapes[] = {{2048, 7168, 1}, {2048, 7168, 17}, {163840, 128, 128}, {300, 33, 1000}, {10, 5, 3},
                          {100, 4100, 3}, {100, 8200, 2}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "vocab " << s.vocab << " dim " << s.dim << " n " << s.n_tokens);
    std::vector<float> table = random_floats(static_cast<size_t>(s.vocab * s.dim), 1.0f, 11);
    const std::vector<int32_t> ids = random_ids(s.n_tokens, s.vocab, 12);
    const size_t n_out = static_cast<size_t>(s.n_tokens * s.dim);
    const EmbeddingParams p{s.n_tokens, s.vocab, s.dim};
    const cuda::DeviceBuffer d_ids = cuda::upload(ids);
    cuda::DeviceBuffer d_flag = cuda::upload(std::vector<int32_t>{0});

    // fp32 table: the GPU rounds each value to bf16 once.
    std::vector<float> ref(n_out);
    ops::embedding_cpu(view_of(table.data(), DType::kF32, s.vocab, s.dim), ids.data(), s.n_tokens, ref.data());
    const cuda::DeviceBuffer d_f32 = cuda::upload(table);
    cuda::DeviceBuffer out = poisoned(n_out * 2);
    ops::embedding_cuda(p, d_f32.as<float>(), d_ids.as<int32_t>(), bf16_ptr(out), d_flag.as<int32_t>(), nullptr);
    sync_device();
    EXPECT_EQ(first_mismatch(download_bf16(out, n_out), round_bf16(ref)), -1);

    // bf16 table: an exact copy.
    const std::vector<uint16_t> bits = to_bf16(table);
    ops::embedding_cpu(view_of(bits.data(), DType::kBF16, s.vocab, s.dim), ids.data(), s.n_tokens, ref.data());
    const cuda::DeviceBuffer d_bf16 = cuda::upload(bits);
    out.fill_bytes(0xff);
    ops::embedding_cuda(p, d_bf16.as<__nv_bfloat16>(), d_ids.as<int32_t>(), bf16_ptr(out), d_flag.as<int32_t>(),
                        nullptr);
    sync_device();
    EXPECT_EQ(first_mismatch(download_bf16(out, n_out), ref), -1);
    EXPECT_EQ(cuda::download<int32_t>(d_flag, 1)[0], 0);
  }
}

TEST(EmbeddingParity, OutOfRangeIdsGiveNanRowsAndRaiseTheFlag) {
  BG_REQUIRE_GPU();
  const int64_t vocab = 50, dim = 40;
  std::vector<float> table = random_floats(static_cast<size_t>(vocab * dim), 1.0f, 13);
  const cuda::DeviceBuffer d_table = upload_bf16(table);
  const std::vector<int32_t> ids = {-1, 7, static_cast<int32_t>(vocab), 1 << 30, 49};
  const cuda::DeviceBuffer d_ids = cuda::upload(ids);
  cuda::DeviceBuffer d_flag = cuda::upload(std::vector<int32_t>{0});
  cuda::DeviceBuffer out(ids.size() * dim * 2);
  out.fill_bytes(0);  // zeros, not NaN: the NaN rows must come from the kernel
  ops::embedding_cuda({5, vocab, dim}, bf16_ptr(d_table), d_ids.as<int32_t>(), bf16_ptr(out), d_flag.as<int32_t>(),
                      nullptr);
  sync_device();
  const std::vector<float> got = download_bf16(out, ids.size() * dim);
  EXPECT_EQ(cuda::download<int32_t>(d_flag, 1)[0], 1);
  for (size_t t = 0; t < ids.size(); ++t) {
    const bool bad = ids[t] < 0 || ids[t] >= vocab;
    for (int64_t i = 0; i < dim; ++i) {
      const float v = got[t * dim + static_cast<size_t>(i)];
      if (bad) {
        ASSERT_TRUE(std::isnan(v)) << "token " << t << " i " << i;
      } else {
        ASSERT_EQ(v, table[static_cast<size_t>(ids[t] * dim + i)]) << "token " << t << " i " << i;
      }
    }
  }
  // A null flag is allowed: the NaN rows are still written.
  ops::embedding_cuda({5, vocab, dim}, bf16_ptr(d_table), d_ids.as<int32_t>(), bf16_ptr(out), nullptr, nullptr);
  sync_device();
  EXPECT_THROW(ops::embedding_cuda({1, 0, dim}, bf16_ptr(d_table), d_ids.as<int32_t>(), bf16_ptr(out), nullptr, nullptr),
               Error);
}

}  // namespace
}  // namespace bg::testing
