// MLA CUDA ops against the CPU reference at real dims (kv_lora 512, rope 64, nope 128, v 128): the paged bf16 cache
// write (bit-exact, nothing else touched) and absorbed attention (bf16 out, 1e-2) for decode batches, one long prefill
// and a mixed batch, each sequence on shuffled, non-contiguous blocks of a two-layer pool. Then the same at the small
// dims of the golden and random test checkpoints (kv_lora 32 / 48, rope 8..32, nope 8..32, v 8..32) and at odd dims
// (entries that are not a multiple of 8 elements, misaligned cache bases and latents: the element-wise paths). The
// prefill path's tests are in mla_prefill_parity_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "cuda/mla_testing.h"
#include "cuda_testing.h"
#include "ops/mla/mla.h"
#include "ops/mla/mla_cuda.h"
#include "ops/linear/linear_cuda.h"
#include "ops/mla/mla_decode_cuda.h"
#include "ops/mla/mla_prefill_cuda.h"

namespace bg::ops {
namespace {

using namespace mla_testing;  // NOLINT: the shared MLA test helpers


// Writes the sequences' latents and compares the whole pool bit for bit with the expected layout.
void check_cache_write(const Dims& d, std::vector<int64_t> lens, int64_t base_offset, int64_t latent_offset,
                       uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "lora " << d.lora << " rope " << d.rope << " block " << d.block
                                    << " base offset " << base_offset << " latent offset " << latent_offset);
  PagedSequences seqs(std::move(lens), seed, d, base_offset);
  seqs.write_all(seed + 1, latent_offset);
  const int64_t entry = d.entry();
  const size_t n_elems = static_cast<size_t>(seqs.pool_elems());
  const std::vector<uint16_t> pool = cuda::download<uint16_t>(seqs.pool, n_elems);
  std::vector<uint16_t> want(n_elems, 0xffff);
  for (size_t s = 0; s < seqs.lengths.size(); ++s) {
    for (int64_t pos = 0; pos < seqs.lengths[s]; ++pos) {
      const int32_t block = seqs.tables[s * static_cast<size_t>(seqs.max_blocks) + pos / d.block];
      std::copy_n(seqs.bits[s].data() + pos * entry, entry, want.begin() + seqs.pool_index(block, pos % d.block));
    }
  }
  size_t n_diff = 0;
  for (size_t i = 0; i < n_elems; ++i) n_diff += pool[i] != want[i];
  EXPECT_EQ(n_diff, 0u) << "cache elements differing from the expected paged layout (layer 0 and unused slots must "
                           "keep their poison)";
}

TEST(MlaCuda, CacheWriteIsExactAndTouchesNothingElse) {
  BG_REQUIRE_GPU();
  check_cache_write(kProd, {1, 63, 64, 65, 200, 3000}, 0, 0, 7);
}

TEST(MlaCuda, CacheWriteSmallAndUnalignedEntriesIsExact) {
  BG_REQUIRE_GPU();
  const std::vector<int64_t> lens = {1, 5, 63, 64, 65, 300};
  // Small entries that are multiples of 8 elements (16-byte copies): golden 32 | 16, random 48 | 8 and 32 | 32.
  check_cache_write({32, 16, 16, 16, 16}, lens, 0, 0, 51);
  check_cache_write({48, 8, 8, 8, 16}, lens, 0, 0, 52);
  check_cache_write({32, 32, 32, 8, 64}, lens, 0, 0, 53);
  // Entries that are not (element copies): 37 | 5 on blocks of 5 (every other block base misaligned), 33 | 0, 1 | 0.
  check_cache_write({37, 5, 7, 3, 5}, lens, 0, 0, 54);
  check_cache_write({33, 0, 8, 8, 16}, lens, 0, 0, 55);
  check_cache_write({1, 0, 1, 1, 3}, lens, 0, 0, 56);
  // 576-element entries on a misaligned pool, and from a misaligned latent: element copies too.
  check_cache_write(kProd, lens, 1, 0, 57);
  check_cache_write(kProd, lens, 0, 3, 58);
  check_cache_write({32, 16, 16, 16, 16}, lens, 5, 1, 59);
}

// A decode graph's padding rows (MlaPagedCache::live_tokens) write nothing: a step of one token per sequence at
// position 3, the last two rows padding, leaves those two positions' poison and writes the others exactly.
TEST(MlaCuda, CacheWriteSkipsPaddingRows) {
  BG_REQUIRE_GPU();
  PagedSequences seqs({4, 4, 4, 4, 4}, 61);
  const int64_t entry = seqs.dims.entry(), live = 3;
  std::vector<int32_t> seq_idx{0, 1, 2, 3, 4};
  std::vector<int64_t> positions(5, 3);
  std::vector<uint16_t> latent;
  for (size_t s = 0; s < 5; ++s) {
    latent.insert(latent.end(), seqs.bits[s].data() + 3 * entry, seqs.bits[s].data() + 4 * entry);
  }
  DeviceBuffer d_seq = cuda::upload(seq_idx), d_pos = cuda::upload(positions), d_lat = cuda::upload(latent);
  DeviceBuffer d_live = cuda::upload(std::vector<int32_t>{static_cast<int32_t>(live)});
  MlaParams p{};
  p.n_tokens = 5;
  p.kv_lora_rank = seqs.dims.lora;
  p.qk_rope_dim = seqs.dims.rope;
  p.block_size = seqs.dims.block;
  MlaPagedCache cache = seqs.cache_view(d_seq, d_pos);
  cache.live_tokens = d_live.as<int32_t>();
  mla_cache_write_cuda(p, d_lat.as<__nv_bfloat16>(), cache, nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> pool = cuda::download<uint16_t>(seqs.pool, static_cast<size_t>(seqs.pool_elems()));
  for (size_t s = 0; s < 5; ++s) {
    const int32_t block = seqs.tables[s * static_cast<size_t>(seqs.max_blocks) + 3 / seqs.dims.block];
    const auto at = pool.begin() + seqs.pool_index(block, 3 % seqs.dims.block);
    if (static_cast<int64_t>(s) < live) {
      EXPECT_TRUE(std::equal(at, at + entry, seqs.bits[s].data() + 3 * entry)) << "row " << s << " not written";
    } else {
      EXPECT_TRUE(std::all_of(at, at + entry, [](uint16_t v) { return v == 0xffff; })) << "padding row " << s;
    }
  }
}

TEST(MlaCuda, DecodeBatchMatchesCpuDeepSeekHeads) {
  BG_REQUIRE_GPU();
  const std::vector<int64_t> lens = {1, 2, 31, 63, 64, 65, 127, 500, 1023, 2048, 2999, 3000};
  PagedSequences seqs(lens, 11);
  seqs.write_all(12);
  AttentionCase c{128, kDeepSeekScale, {}, {}};
  for (size_t s = 0; s < lens.size(); ++s) c.tokens.push_back({static_cast<int32_t>(s), lens[s] - 1});
  std::shuffle(c.tokens.begin(), c.tokens.end(), std::mt19937_64(13));
  c.checked = all_indices(c.tokens.size());
  run_attention(seqs, c, 14);
}

TEST(MlaCuda, DecodeBatchMatchesCpuK3HeadsAndPartialHeadGroup) {
  BG_REQUIRE_GPU();
  const std::vector<int64_t> lens = {1, 64, 65, 777, 3000};
  PagedSequences seqs(lens, 21);
  seqs.write_all(22);
  // 96 heads (Kimi-K3) and 12 (K3 split 8 ways: the second group of 8 heads is half empty).
  for (int64_t heads : {96, 12}) {
    AttentionCase c{heads, kK3Scale, {}, {}};
    for (size_t s = 0; s < lens.size(); ++s) c.tokens.push_back({static_cast<int32_t>(s), lens[s] - 1});
    // Also earlier positions of the same sequences: the causal limit is per token, not per sequence.
    c.tokens.push_back({4, 0});
    c.tokens.push_back({4, 1234});
    c.tokens.push_back({3, 63});
    c.checked = all_indices(c.tokens.size());
    run_attention(seqs, c, 23 + static_cast<uint64_t>(heads));
  }
}

TEST(MlaCuda, LongPrefillMatchesCpuOnSampledTokens) {
  BG_REQUIRE_GPU();
  const int64_t len = 3000;
  PagedSequences seqs({len}, 31);
  seqs.write_all(32);
  AttentionCase c{128, kDeepSeekScale, {}, {}};
  for (int64_t pos = 0; pos < len; ++pos) c.tokens.push_back({0, pos});
  // Block and tile edges, the ends, and a random sample (the CPU reference over all 3000 would take minutes).
  for (int64_t pos : {0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 2047, 2048, 2998, 2999})
    c.checked.push_back(static_cast<size_t>(pos));
  std::mt19937_64 rng(33);
  for (int i = 0; i < 24; ++i) c.checked.push_back(static_cast<size_t>(rng() % len));
  run_attention(seqs, c, 34);
}

TEST(MlaCuda, MixedPrefillChunkAndDecodeBatchMatchesCpu) {
  BG_REQUIRE_GPU();
  // Sequence 0 continues a prefill: tokens at 1000..1199 after a 1000-token prefix. The others decode one token.
  const std::vector<int64_t> lens = {1200, 5, 66, 1500, 129};
  PagedSequences seqs(lens, 41);
  seqs.write_all(42);
  AttentionCase c{96, kK3Scale, {}, {}};
  for (size_t s = 1; s < lens.size(); ++s) c.tokens.push_back({static_cast<int32_t>(s), lens[s] - 1});
  for (int64_t pos = 1000; pos < 1200; ++pos) c.tokens.push_back({0, pos});
  c.tokens.push_back({2, 10});
  for (size_t i = 0; i < c.tokens.size(); i += (i < 8 ? 1 : 7)) c.checked.push_back(i);
  c.checked.push_back(c.tokens.size() - 1);
  c.checked.push_back(c.tokens.size() - 2);
  run_attention(seqs, c, 43);
}

// Small shapes: sequences with contexts 1..300, decoded (last position and some earlier ones) and prefilled (every
// position of the 300-token sequence, a chunk of the 150-token one) in one shuffled batch, every token checked
// (every 5th for shapes near production size, where the CPU reference is slow).
void run_small_shape(const Dims& d, int64_t heads, int64_t base_offset, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "lora " << d.lora << " rope " << d.rope << " nope " << d.nope << " v " << d.v
                                    << " block " << d.block << " heads " << heads << " base offset " << base_offset);
  const std::vector<int64_t> lens = {1, 2, 17, 63, 64, 65, 150, 299, 300};
  PagedSequences seqs(lens, seed, d, base_offset);
  seqs.write_all(seed + 1);
  AttentionCase c{heads, 1.0f / std::sqrt(static_cast<float>(d.nope + d.rope)), {}, {}};
  for (size_t s = 0; s < lens.size(); ++s) c.tokens.push_back({static_cast<int32_t>(s), lens[s] - 1});
  c.tokens.push_back({3, 0});
  c.tokens.push_back({7, 31});
  c.tokens.push_back({7, 32});
  for (int64_t pos = 0; pos < 300; ++pos) c.tokens.push_back({8, pos});
  for (int64_t pos = 100; pos < 150; ++pos) c.tokens.push_back({6, pos});
  std::shuffle(c.tokens.begin(), c.tokens.end(), std::mt19937_64(seed + 2));
  const size_t step = d.lora * d.nope >= 256 * 64 ? 5 : 1;
  for (size_t i = 0; i < c.tokens.size(); i += step) c.checked.push_back(i);
  run_attention(seqs, c, seed + 3);
}

TEST(MlaCuda, GoldenCheckpointDimsMatchCpu) {
  BG_REQUIRE_GPU();
  // The golden test checkpoints: kv_lora 32, rope 16, nope 16 or 32, v 16 or 32, 4 heads.
  run_small_shape({32, 16, 16, 16, 16}, 4, 0, 600);
  run_small_shape({32, 16, 32, 32, 16}, 4, 0, 610);
  run_small_shape({32, 16, 16, 32, 64}, 4, 0, 620);
  run_small_shape({32, 16, 32, 16, 7}, 4, 0, 630);
}

TEST(MlaCuda, RandomCheckpointDimsMatchCpu) {
  BG_REQUIRE_GPU();
  // Random test checkpoints: nope / rope / v 8 / 8 / 24 and 32 / 32 / 8, kv_lora 48 (and 32).
  run_small_shape({32, 8, 8, 24, 16}, 4, 0, 700);
  run_small_shape({48, 8, 8, 24, 16}, 2, 0, 710);
  run_small_shape({32, 32, 32, 8, 16}, 12, 0, 720);  // a half-empty second head group
  run_small_shape({48, 16, 16, 16, 32}, 3, 0, 730);
}

TEST(MlaCuda, OddDimsAndUnalignedCacheMatchCpu) {
  BG_REQUIRE_GPU();
  // Entries that are not a multiple of 8 elements (element-wise cache writes and loads), rope 0, one channel.
  run_small_shape({37, 5, 7, 3, 5}, 3, 0, 800);
  run_small_shape({33, 0, 8, 8, 16}, 9, 0, 810);
  run_small_shape({1, 0, 1, 1, 3}, 1, 0, 820);
  run_small_shape({100, 64, 64, 40, 32}, 10, 0, 830);
  run_small_shape({512, 0, 16, 16, 16}, 8, 0, 840);
  run_small_shape({511, 63, 32, 32, 16}, 8, 0, 850);
  // A misaligned cache: the padded path, also at the production shape.
  run_small_shape({32, 16, 16, 16, 16}, 4, 1, 860);
  run_small_shape(kProd, 16, 1, 870);
}

TEST(MlaCuda, RejectsUnsupportedShapes) {
  BG_REQUIRE_GPU();
  // Real buffers, so that only the shape can be what is rejected.
  const Dims d{32, 16, 16, 16, 16};
  PagedSequences seqs({4}, 61, d);
  seqs.write_all(62);
  DeviceBuffer d_seq = cuda::upload(std::vector<int32_t>{0}), d_pos = cuda::upload(std::vector<int64_t>{3});
  DeviceBuffer q(1 << 20), w_uk(1 << 20), w_uv(1 << 20), out(1 << 20), latent(1 << 20);
  q.fill_bytes(0);
  w_uk.fill_bytes(0);
  w_uv.fill_bytes(0);
  latent.fill_bytes(0);
  const MlaPagedCache c = seqs.cache_view(d_seq, d_pos);
  auto attention = [&](const MlaParams& p) {
    mla_attention_cuda(p, q.as<__nv_bfloat16>(), w_uk.as<__nv_bfloat16>(), w_uv.as<__nv_bfloat16>(), c,
                       out.as<__nv_bfloat16>(), nullptr);
  };
  auto write = [&](const MlaParams& p) { mla_cache_write_cuda(p, latent.as<__nv_bfloat16>(), c, nullptr); };
  const MlaParams ok{1, 4, d.lora, d.nope, d.rope, d.v, d.block, 0.1f};
  EXPECT_NO_THROW(attention(ok));
  EXPECT_NO_THROW(write(ok));
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  // Latent shapes beyond the maxima (kv_lora_rank in [1, 512], qk_rope_dim in [0, 64]).
  for (const auto& [lora, rope] : std::vector<std::pair<int64_t, int64_t>>{
           {513, 64}, {1024, 64}, {0, 16}, {-32, 16}, {512, 65}, {32, 128}, {32, -1}}) {
    MlaParams p = ok;
    p.kv_lora_rank = lora;
    p.qk_rope_dim = rope;
    p.block_size = 1;  // the view's block stride holds any of these entries: only the shape can be rejected
    EXPECT_THROW(attention(p), Error) << lora << " / " << rope;
    EXPECT_THROW(write(p), Error) << lora << " / " << rope;
  }
  MlaParams p = ok;
  p.qk_nope_dim = 2000;  // nope + rope past the query staging buffer
  EXPECT_THROW(attention(p), Error);
  p = ok;
  p.qk_nope_dim = 0;
  EXPECT_THROW(attention(p), Error);
  // A supported shape with null pointers.
  EXPECT_THROW(mla_attention_cuda(ok, nullptr, nullptr, nullptr, c, nullptr, nullptr), Error);
  EXPECT_THROW(mla_cache_write_cuda(ok, nullptr, c, nullptr), Error);
}

}  // namespace
}  // namespace bg::ops
