// The MLA cache writes over strided latents (kv_a's columns of a fused projection's output, read in place) and the
// normed write (kv_a's RMSNorm and the cache write in one launch, Kimi-K3): each against the packed write, or
// rmsnorm_cuda then the write, bit for bit, over the whole pool, at the production latent, the test checkpoints' small
// ones and an odd one (element copies).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/mla_testing.h"
#include "cuda_testing.h"
#include "ops/mla/mla_cuda.h"
#include "ops/rmsnorm/rmsnorm_cuda.h"

namespace bg::ops {
namespace {

using namespace mla_testing;  // NOLINT: the shared MLA test helpers

// Every position of every sequence, as one step's tokens, with latents [n, ld] whose entries sit at column `col`.
struct StridedStep {
  std::vector<int32_t> seq_idx;
  std::vector<int64_t> positions;
  std::vector<uint16_t> latents;  // [n, ld] bf16, random everywhere (the columns outside the entry too)
  int64_t ld = 0, col = 0;

  StridedStep(const std::vector<int64_t>& lens, int64_t ld_, int64_t col_, uint64_t seed)
      : ld(ld_), col(col_) {
    for (size_t s = 0; s < lens.size(); ++s) {
      for (int64_t p = 0; p < lens[s]; ++p) {
        seq_idx.push_back(static_cast<int32_t>(s));
        positions.push_back(p);
      }
    }
    std::vector<float> v = testing::random_floats(seq_idx.size() * static_cast<size_t>(ld), 2.0f, seed);
    latents = testing::to_bf16(v);
  }
  int64_t n() const { return static_cast<int64_t>(seq_idx.size()); }
  // The entries alone, packed [n, entry].
  std::vector<uint16_t> packed(int64_t entry) const {
    std::vector<uint16_t> out;
    for (int64_t t = 0; t < n(); ++t) {
      const auto row = latents.begin() + t * ld + col;
      out.insert(out.end(), row, row + entry);
    }
    return out;
  }
};

MlaParams write_params(const Dims& d, int64_t n) {
  MlaParams p{};
  p.n_tokens = n;
  p.kv_lora_rank = d.lora;
  p.qk_rope_dim = d.rope;
  p.block_size = d.block;
  return p;
}

std::vector<uint16_t> pool_bits(const PagedSequences& seqs) {
  return cuda::download<uint16_t>(seqs.pool, static_cast<size_t>(seqs.pool_elems()));
}

size_t n_differing(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  EXPECT_EQ(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) n += a[i] != b[i];
  return n;
}

const std::vector<int64_t> kLens = {1, 5, 63, 64, 65, 130};

// Two pools with the same block tables (same seed): one written from packed latents, one from the strided view.
void check_strided_write(const Dims& d, int64_t ld, int64_t col, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "lora " << d.lora << " rope " << d.rope << " ld " << ld << " col " << col);
  PagedSequences want(kLens, seed, d), got(kLens, seed, d);
  const StridedStep step(kLens, ld, col, seed + 1);
  const DeviceBuffer d_seq = cuda::upload(step.seq_idx), d_pos = cuda::upload(step.positions);
  const DeviceBuffer d_packed = cuda::upload(step.packed(d.entry())), d_all = cuda::upload(step.latents);
  const MlaParams p = write_params(d, step.n());
  mla_cache_write_cuda(p, d_packed.as<__nv_bfloat16>(), want.cache_view(d_seq, d_pos), nullptr);
  mla_cache_write_cuda(p, d_all.as<__nv_bfloat16>() + col, got.cache_view(d_seq, d_pos), nullptr, ld);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(n_differing(pool_bits(got), pool_bits(want)), 0u);
}

TEST(MlaCuda, CacheWriteReadsStridedLatents) {
  BG_REQUIRE_GPU();
  check_strided_write(kProd, 576 + 1536 + 96 * 64, 1536, 71);  // K3's [q_a | kv_a | gate] row: 16-byte copies
  check_strided_write(kProd, 600, 8, 72);                       // 16-byte copies
  check_strided_write(kProd, 581, 3, 73);                       // misaligned rows: element copies
  check_strided_write({32, 16, 16, 16, 16}, 72, 16, 74);
  check_strided_write({37, 5, 7, 3, 5}, 50, 1, 75);
  PagedSequences seqs({4}, 76);
  const DeviceBuffer d_seq = cuda::upload(std::vector<int32_t>{0}), d_pos = cuda::upload(std::vector<int64_t>{3});
  DeviceBuffer latent(1 << 12);
  EXPECT_THROW(mla_cache_write_cuda(write_params(kProd, 1), latent.as<__nv_bfloat16>(), seqs.cache_view(d_seq, d_pos),
                                    nullptr, 575),
               Error);  // rows closer than one entry
}

// The normed write against rmsnorm_cuda over a copy of the latents, then the plain write; the latents left as they
// were. `live`: padding rows from there on (a decode graph's), which write nothing in either.
void check_normed_write(const Dims& d, int64_t ld, int64_t col, uint64_t seed, int64_t live = -1) {
  SCOPED_TRACE(::testing::Message() << "lora " << d.lora << " rope " << d.rope << " ld " << ld << " live " << live);
  constexpr float kEps = 1e-6f;
  PagedSequences want(kLens, seed, d), got(kLens, seed, d);
  const StridedStep step(kLens, ld, col, seed + 1);
  std::vector<float> w = testing::random_floats(static_cast<size_t>(d.lora), 1.0f, seed + 2);
  const DeviceBuffer d_seq = cuda::upload(step.seq_idx), d_pos = cuda::upload(step.positions);
  const DeviceBuffer d_all = cuda::upload(step.latents), d_normed = cuda::upload(step.latents), d_w = cuda::upload(w);
  const DeviceBuffer d_live = cuda::upload(std::vector<int32_t>{static_cast<int32_t>(live)});
  const MlaParams p = write_params(d, step.n());
  MlaPagedCache want_cache = want.cache_view(d_seq, d_pos), got_cache = got.cache_view(d_seq, d_pos);
  if (live >= 0) want_cache.live_tokens = got_cache.live_tokens = d_live.as<int32_t>();
  auto* normed = d_normed.as<__nv_bfloat16>() + col;
  rmsnorm_cuda({step.n(), d.lora, kEps}, {ld, ld}, normed, d_w.as<float>(), normed, nullptr);
  mla_cache_write_cuda(p, normed, want_cache, nullptr, ld);
  mla_cache_write_normed_cuda(p, d_all.as<__nv_bfloat16>() + col, d_w.as<float>(), kEps, got_cache, nullptr, ld);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got_bits = pool_bits(got), want_bits = pool_bits(want);
  EXPECT_EQ(n_differing(got_bits, want_bits), 0u);
  EXPECT_NE(n_differing(want_bits, std::vector<uint16_t>(want_bits.size(), 0xffff)), 0u) << "nothing was written";
  EXPECT_EQ(n_differing(cuda::download<uint16_t>(d_all, step.latents.size()), step.latents), 0u)
      << "the latents were changed";
}

TEST(MlaCuda, NormedCacheWriteMatchesNormThenWrite) {
  BG_REQUIRE_GPU();
  check_normed_write(kProd, 576, 0, 81);                      // packed
  check_normed_write(kProd, 576 + 1536 + 96 * 64, 1536, 82);  // K3's fused row
  check_normed_write(kProd, 581, 3, 83);                      // misaligned rows
  check_normed_write({32, 16, 16, 16, 16}, 72, 16, 84);
  check_normed_write({48, 8, 8, 8, 16}, 56, 0, 85);
  check_normed_write({37, 5, 7, 3, 5}, 50, 1, 86);
  check_normed_write({1, 0, 1, 1, 3}, 1, 0, 87);
  check_normed_write(kProd, 576, 0, 88, 100);  // padding rows past 100 of the 328 tokens
  DeviceBuffer latent(1 << 12), w(1 << 12);
  PagedSequences seqs({4}, 89);
  const DeviceBuffer d_seq = cuda::upload(std::vector<int32_t>{0}), d_pos = cuda::upload(std::vector<int64_t>{3});
  const MlaPagedCache c = seqs.cache_view(d_seq, d_pos);
  EXPECT_THROW(mla_cache_write_normed_cuda(write_params(kProd, 1), latent.as<__nv_bfloat16>(), nullptr, 1e-6f, c,
                                           nullptr),
               Error);
  MlaParams too_wide = write_params(kProd, 1);
  too_wide.kv_lora_rank = 1024;
  EXPECT_THROW(mla_cache_write_normed_cuda(too_wide, latent.as<__nv_bfloat16>(), w.as<float>(), 1e-6f, c, nullptr),
               Error);
}

}  // namespace
}  // namespace bg::ops
