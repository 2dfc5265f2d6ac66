// MLA CUDA ops against the CPU reference at real dims (kv_lora 512, rope 64, nope 128, v 128): the paged bf16 cache
// write (bit-exact, nothing else touched) and absorbed attention (bf16 out, 1e-2) for decode batches, one long prefill
// and a mixed batch, each sequence on shuffled, non-contiguous blocks of a two-layer pool. Then the same at the small
// dims of the golden and random test checkpoints (kv_lora 32 / 48, rope 8..32, nope 8..32, v 8..32) and at odd dims
// (entries that are not a multiple of 8 elements, misaligned cache bases and latents: the element-wise paths).
// Last, the non-absorbed prefill path (mla_prefill_cuda.h) with the absorbed kernel on the other tokens of the step,
// as the CUDA backend runs it: fresh prompts, prefix + chunk, ragged mixed steps, contexts cut into several passes
// (state carried in fp32), the production dims and the padded small ones.
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

#include "cuda_testing.h"
#include "ops/mla/mla.h"
#include "ops/mla/mla_cuda.h"
#include "ops/linear/linear_cuda.h"
#include "ops/mla/mla_decode_cuda.h"
#include "ops/mla/mla_prefill_cuda.h"

namespace bg::ops {
namespace {

using cuda::DeviceBuffer;
using testing::from_bf16;
using testing::random_floats;
using testing::to_bf16;

// The shape of one test: latent dims, head dims and the cache block size.
struct Dims {
  int64_t lora, rope, nope, v, block;
  int64_t entry() const { return lora + rope; }
};
constexpr Dims kProd{512, 64, 128, 128, 64};  // DeepSeek-V3 / Kimi
constexpr int64_t kLayers = 2, kLayer = 1;   // the pool holds 2 MLA layers; the tests use layer 1 (stride != size)
constexpr float kDeepSeekScale = 0.135234f;  // 192^-0.5 * yarn mscale^2 (factor 40)
const float kK3Scale = 1.0f / std::sqrt(192.0f);

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Sequences with written latents on a shuffled paged pool, mirrored on the host (fp32 values of the bf16 latents).
// base_offset (elements) shifts the pool's start, latent_offset the latents' upload: odd values misalign them.
struct PagedSequences {
  Dims dims;
  int64_t base_offset;
  std::vector<int64_t> lengths;  // cache positions written per sequence
  int64_t n_blocks = 0, max_blocks = 0;
  std::vector<int32_t> tables;              // [n_seqs, max_blocks], -1 past a sequence's blocks
  std::vector<std::vector<float>> latents;  // per sequence [ceil(len / block) * block, entry] fp32 (bf16 values)
  std::vector<std::vector<uint16_t>> bits;  // per sequence [len, entry] bf16
  DeviceBuffer pool;  // [base_offset + n_blocks * kLayers * block * entry] bf16, poisoned then written
  DeviceBuffer d_tables;

  PagedSequences(std::vector<int64_t> lens, uint64_t seed, Dims d = kProd, int64_t base_off = 0)
      : dims(d), base_offset(base_off), lengths(std::move(lens)) {
    const int64_t block = dims.block, entry = dims.entry();
    std::mt19937_64 rng(seed);
    for (int64_t len : lengths) {
      n_blocks += ceil_div(len, block);
      max_blocks = std::max(max_blocks, ceil_div(len, block) + 1);  // one spare table entry, never used
    }
    n_blocks += 5;  // blocks no sequence owns stay poisoned
    std::vector<int32_t> physical(static_cast<size_t>(n_blocks));
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), rng);
    tables.assign(lengths.size() * static_cast<size_t>(max_blocks), -1);
    size_t next = 0;
    for (size_t s = 0; s < lengths.size(); ++s) {
      const int64_t nb = ceil_div(lengths[s], block);
      for (int64_t b = 0; b < nb; ++b) tables[s * static_cast<size_t>(max_blocks) + b] = physical[next++];
      std::vector<float> lat = random_floats(static_cast<size_t>(lengths[s] * entry), 1.0f, seed * 131 + s);
      bits.push_back(to_bf16(lat));
      lat.resize(static_cast<size_t>(nb * block * entry), 0.0f);
      latents.push_back(std::move(lat));
    }
    pool = DeviceBuffer(static_cast<size_t>(pool_elems()) * 2);
    pool.fill_bytes(0xff);
    d_tables = cuda::upload(tables);
  }

  int64_t pool_elems() const { return base_offset + n_blocks * kLayers * dims.block * dims.entry(); }
  // The CPU reference for one query token of sequence s at position pos: [heads, v] (p.n_tokens is ignored).
  std::vector<float> reference(const MlaParams& p, const float* q_row, const float* w_uk, const float* w_uv, int32_t s,
                               int64_t pos) const {
    const std::vector<float>& lat = latents[static_cast<size_t>(s)];
    std::vector<const float*> blocks;
    for (size_t off = 0; off < lat.size(); off += static_cast<size_t>(dims.block * dims.entry())) {
      blocks.push_back(&lat[off]);
    }
    MlaParams one = p;
    one.n_tokens = 1;
    std::vector<float> ref(static_cast<size_t>(p.n_heads * p.v_head_dim));
    mla_attention_cpu(one, q_row, w_uk, w_uv, blocks.data(), &pos, ref.data());
    return ref;
  }
  // Element index in the pool of (physical block, slot).
  int64_t pool_index(int32_t block, int64_t slot) const {
    return base_offset + ((block * kLayers + kLayer) * dims.block + slot) * dims.entry();
  }

  MlaPagedCache cache_view(const DeviceBuffer& seq_idx, const DeviceBuffer& positions) const {
    MlaPagedCache c;
    c.base = pool.as<__nv_bfloat16>() + base_offset + kLayer * dims.block * dims.entry();
    c.block_stride = kLayers * dims.block * dims.entry();
    c.block_tables = d_tables.as<int32_t>();
    c.max_blocks_per_seq = max_blocks;
    c.seq_idx = seq_idx.as<int32_t>();
    c.positions = positions.as<int64_t>();
    return c;
  }

  // Writes every sequence's latents with one launch, tokens in a shuffled order.
  void write_all(uint64_t seed, int64_t latent_offset = 0) {
    const int64_t entry = dims.entry();
    std::vector<int32_t> seq_idx;
    std::vector<int64_t> positions;
    for (size_t s = 0; s < lengths.size(); ++s) {
      for (int64_t p = 0; p < lengths[s]; ++p) {
        seq_idx.push_back(static_cast<int32_t>(s));
        positions.push_back(p);
      }
    }
    std::vector<size_t> order(seq_idx.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    std::vector<int32_t> seq_sh;
    std::vector<int64_t> pos_sh;
    std::vector<uint16_t> latent(static_cast<size_t>(latent_offset), 0xffff);  // [n, entry], shuffled token order
    for (size_t i : order) {
      seq_sh.push_back(seq_idx[i]);
      pos_sh.push_back(positions[i]);
      const uint16_t* src = bits[static_cast<size_t>(seq_idx[i])].data() + positions[i] * entry;
      latent.insert(latent.end(), src, src + entry);
    }
    DeviceBuffer d_seq = cuda::upload(seq_sh), d_pos = cuda::upload(pos_sh), d_lat = cuda::upload(latent);
    MlaParams p{};
    p.n_tokens = static_cast<int64_t>(seq_sh.size());
    p.kv_lora_rank = dims.lora;
    p.qk_rope_dim = dims.rope;
    p.block_size = dims.block;
    mla_cache_write_cuda(p, d_lat.as<__nv_bfloat16>() + latent_offset, cache_view(d_seq, d_pos), nullptr);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

// One attention launch over `tokens` (sequence, position) pairs, checked against mla_attention_cpu per sequence.
struct AttentionCase {
  int64_t n_heads;
  float scale;
  std::vector<std::pair<int32_t, int64_t>> tokens;  // what the GPU computes, in batch order
  std::vector<size_t> checked;                      // indices into tokens that the CPU reference checks
};

void run_attention(PagedSequences& seqs, const AttentionCase& c, uint64_t seed) {
  const Dims& d = seqs.dims;
  const int64_t lora = d.lora, nope = d.nope, v_head = d.v, block = d.block;
  const int64_t n = static_cast<int64_t>(c.tokens.size()), nh = c.n_heads, qk = d.nope + d.rope;
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(lora));
  std::vector<float> q = random_floats(static_cast<size_t>(n * nh * qk), 1.0f, seed);
  std::vector<float> w_uk = random_floats(static_cast<size_t>(nh * nope * lora), w_scale, seed + 1);
  std::vector<float> w_uv = random_floats(static_cast<size_t>(nh * v_head * lora), w_scale, seed + 2);
  DeviceBuffer d_q = cuda::upload(to_bf16(q)), d_uk = cuda::upload(to_bf16(w_uk)), d_uv = cuda::upload(to_bf16(w_uv));
  std::vector<int32_t> seq_idx;
  std::vector<int64_t> positions;
  for (const auto& [s, pos] : c.tokens) {
    seq_idx.push_back(s);
    positions.push_back(pos);
  }
  DeviceBuffer d_seq = cuda::upload(seq_idx), d_pos = cuda::upload(positions);
  DeviceBuffer d_out(static_cast<size_t>(n * nh * v_head) * 2);
  d_out.fill_bytes(0xff);
  const MlaParams p{n, nh, lora, nope, d.rope, v_head, block, c.scale};
  mla_attention_cuda(p, d_q.as<__nv_bfloat16>(), d_uk.as<__nv_bfloat16>(), d_uv.as<__nv_bfloat16>(),
                     seqs.cache_view(d_seq, d_pos), d_out.as<__nv_bfloat16>(), nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = from_bf16(cuda::download<uint16_t>(d_out, static_cast<size_t>(n * nh * v_head)));

  const size_t row = static_cast<size_t>(nh * v_head);
  double worst = 0.0;
  for (size_t i : c.checked) {
    const auto& [s, pos] = c.tokens[i];
    const std::vector<float> ref =
        seqs.reference(p, q.data() + i * static_cast<size_t>(nh * qk), w_uk.data(), w_uv.data(), s, pos);
    const std::vector<float> got_row(got.begin() + static_cast<std::ptrdiff_t>(i * row),
                                     got.begin() + static_cast<std::ptrdiff_t>((i + 1) * row));
    const double err = testing::max_rel_error(got_row, ref);
    worst = std::max(worst, err);
    ASSERT_LE(err, testing::kTolBf16Out) << "token " << i << " seq " << s << " pos " << pos << " heads " << nh
                                         << " lora/rope/nope/v " << lora << "/" << d.rope << "/" << nope << "/"
                                         << v_head;
  }
  std::printf("[mla] lora %lld rope %lld nope %lld v %lld block %lld, heads %lld, %lld tokens (%zu checked): max rel "
              "err %.3g\n",
              static_cast<long long>(lora), static_cast<long long>(d.rope), static_cast<long long>(nope),
              static_cast<long long>(v_head), static_cast<long long>(block), static_cast<long long>(nh),
              static_cast<long long>(n), c.checked.size(), worst);
}

std::vector<size_t> all_indices(size_t n) {
  std::vector<size_t> v(n);
  std::iota(v.begin(), v.end(), size_t{0});
  return v;
}

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

// ---- prefill path (mla_prefill_cuda.h) -----------------------------------------------------------------------------

// One step: per sequence, the last n_query[s] of its written positions are the step's query tokens (in sequence
// order, as the scheduler lays a step out). Sequences with at least options.min_tokens queries take the prefill path,
// the others the absorbed kernel over their token ranges; every token is checked against the CPU reference.
// With kCudnn at the production dims, every cuDNN call of the plan must have run, or none with expect_cudnn false
// (a plan still building in the background; `shared` keeps plans across calls when given).
void run_prefill_with(PagedSequences& seqs, const std::vector<int64_t>& n_query, int64_t n_heads,
                      const MlaPrefillOptions& options, uint64_t seed, bool expect_state, MlaPrefillMma mma,
                      MlaCudnnPrefill* shared = nullptr, bool expect_cudnn = true) {
  const Dims& d = seqs.dims;
  const int64_t lora = d.lora, nope = d.nope, v_head = d.v, block = d.block;
  const int64_t nh = n_heads, qk = d.nope + d.rope;
  std::vector<int32_t> seq_idx;
  std::vector<int64_t> positions, seq_begin{0};
  for (size_t s = 0; s < n_query.size(); ++s) {
    for (int64_t p = seqs.lengths[s] - n_query[s]; p < seqs.lengths[s]; ++p) {
      seq_idx.push_back(static_cast<int32_t>(s));
      positions.push_back(p);
    }
    seq_begin.push_back(static_cast<int64_t>(positions.size()));
  }
  const auto n = static_cast<int64_t>(positions.size());
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(lora));
  std::vector<float> q = random_floats(static_cast<size_t>(n * nh * qk), 1.0f, seed);
  std::vector<float> w_uk = random_floats(static_cast<size_t>(nh * nope * lora), w_scale, seed + 1);
  std::vector<float> w_uv = random_floats(static_cast<size_t>(nh * v_head * lora), w_scale, seed + 2);
  DeviceBuffer d_q = cuda::upload(to_bf16(q)), d_uk = cuda::upload(to_bf16(w_uk)), d_uv = cuda::upload(to_bf16(w_uv));
  DeviceBuffer d_seq = cuda::upload(seq_idx), d_pos = cuda::upload(positions);
  DeviceBuffer d_out(static_cast<size_t>(n * nh * v_head) * 2);
  d_out.fill_bytes(0xff);
  const float scale = 1.0f / std::sqrt(static_cast<float>(qk));
  const MlaParams p{n, nh, lora, nope, d.rope, v_head, block, scale};

  const MlaPrefillPlan plan = mla_prefill_plan(positions, seq_begin, options);
  ASSERT_FALSE(plan.empty());
  EXPECT_EQ(plan.needs_state, expect_state);
  const MlaPrefillWorkspace ws = mla_prefill_workspace(p, plan);
  DeviceBuffer d_ws(ws.total_bytes);
  d_ws.fill_bytes(0xff);  // poisoned: every region the launch reads it writes first (but the metadata)
  const std::vector<std::byte> meta = mla_prefill_meta(plan, ws);
  BG_CUDA_CHECK(cudaMemcpy(d_ws.data(), meta.data(), meta.size(), cudaMemcpyHostToDevice));
  cublasHandle_t handle = nullptr;
  BG_CUBLAS_CHECK(cublasCreate(&handle));
  DeviceBuffer cublas_ws(kCublasWorkspaceBytes);
  DeviceBuffer d_flags = cuda::upload(std::vector<int32_t>{0});
  MlaPagedCache cache = seqs.cache_view(d_seq, d_pos);
  cache.error_flags = d_flags.as<int32_t>();
  MlaCudnnPrefill own_cudnn;
  MlaCudnnPrefill& cudnn = shared != nullptr ? *shared : own_cudnn;
  const int64_t launches_before = cudnn.launches();
  const MlaPrefillContext ctx{{handle, cublas_ws.data(), kCublasWorkspaceBytes, d_ws.data(), ws.total_bytes}, &cudnn};
  mla_prefill_cuda(p, plan, ws, d_q.as<__nv_bfloat16>(), d_uk.as<__nv_bfloat16>(), d_uv.as<__nv_bfloat16>(), cache,
                   d_out.as<__nv_bfloat16>(), ctx, nullptr, mma);
  // The other tokens as the backend runs them: runs of single-token sequences through the decode kernel at the
  // production latent shape, anything else through the general kernel.
  int n_sms = 0;
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
  for (const auto& [b, e] : plan.absorbed_runs) {
    MlaParams run = p;
    run.n_tokens = e - b;
    MlaPagedCache pc = cache;
    pc.seq_idx += b;
    pc.positions += b;
    const MlaDecodeTensors t{d_q.as<__nv_bfloat16>() + b * nh * qk, d_uk.as<__nv_bfloat16>(),
                             d_uv.as<__nv_bfloat16>(), d_out.as<__nv_bfloat16>() + b * nh * v_head};
    if (plan.absorbed_single_tokens && mla_decode_takes(run)) {
      const MlaDecodePlan dplan = mla_decode_plan(run, n_sms);
      DeviceBuffer d_dws(dplan.ws.total_bytes);
      mla_decode_cuda(dplan, t, pc, {handle, cublas_ws.data(), kCublasWorkspaceBytes, d_dws.data(),
                                     dplan.ws.total_bytes}, nullptr);
      BG_CUDA_CHECK(cudaDeviceSynchronize());  // d_dws is freed at the end of this scope
    } else {
      mla_attention_cuda(run, t.q, t.w_uk, t.w_uv, pc, t.out, nullptr);
    }
  }
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  BG_CUBLAS_CHECK(cublasDestroy(handle));
  EXPECT_EQ(cuda::download<int32_t>(d_flags, 1)[0], 0);
  const std::vector<float> got = from_bf16(cuda::download<uint16_t>(d_out, static_cast<size_t>(n * nh * v_head)));
  // At the production dims every cuDNN call of the plan ran (all or nothing per step).
  int64_t cudnn_calls = 0;
  if (mma == MlaPrefillMma::kCudnn && nope == kMlaPrefillNope && d.rope == kMlaPrefillRope && v_head == kMlaPrefillV &&
      expect_cudnn) {
    cudnn_calls = static_cast<int64_t>(plan.cudnn_calls.size());
    EXPECT_GT(cudnn_calls, 0);
  }
  EXPECT_EQ(cudnn.launches() - launches_before, cudnn_calls) << cudnn.last_refusal();

  const size_t row = static_cast<size_t>(nh * v_head);
  double worst = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t s = seq_idx[static_cast<size_t>(t)];
    const std::vector<float> ref =
        seqs.reference(p, q.data() + t * nh * qk, w_uk.data(), w_uv.data(), s, positions[static_cast<size_t>(t)]);
    const std::vector<float> got_row(got.begin() + static_cast<std::ptrdiff_t>(t * row),
                                     got.begin() + static_cast<std::ptrdiff_t>((t + 1) * row));
    const double err = testing::max_rel_error(got_row, ref);
    worst = std::max(worst, err);
    ASSERT_LE(err, testing::kTolBf16Out) << mla_prefill_mma_name(mma) << " token " << t << " seq " << s << " pos "
                                         << positions[size_t(t)]
                                         << " lora/rope/nope/v " << lora << "/" << d.rope << "/" << nope << "/"
                                         << v_head;
  }
  std::printf("[mla prefill %s] lora %lld rope %lld nope %lld v %lld block %lld, heads %lld, %lld tokens, %zu "
              "passes (%lld cuDNN calls), %zu items: max rel err %.3g\n",
              mla_prefill_mma_name(mma), static_cast<long long>(lora), static_cast<long long>(d.rope),
              static_cast<long long>(nope),
              static_cast<long long>(v_head), static_cast<long long>(block), static_cast<long long>(nh),
              static_cast<long long>(n), plan.passes.size(), static_cast<long long>(cudnn_calls), plan.items.size(),
              worst);
}

// Both tensor-core kernels on the same step.
void run_prefill(PagedSequences& seqs, const std::vector<int64_t>& n_query, int64_t n_heads,
                 const MlaPrefillOptions& options, uint64_t seed, bool expect_state) {
  for (MlaPrefillMma mma : {MlaPrefillMma::kWgmma, MlaPrefillMma::kMmaSync, MlaPrefillMma::kCudnn}) {
    if (mma == MlaPrefillMma::kCudnn && !MlaCudnnPrefill::built()) continue;
    run_prefill_with(seqs, n_query, n_heads, options, seed, expect_state, mma);
  }
}

TEST(MlaPrefillCudnn, K3HeadsAndBucketsShareOnePlan) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // K3's 96 heads. Fresh prompts of 300 and 400 tokens fall in one bucket (512 queries, 512 keys): one plan, two
  // launches; a 200-token chunk after a 1000-token prefix (bottom-right causal) takes a second plan.
  MlaCudnnPrefill cudnn;
  PagedSequences a({300}, 940), b({400}, 941), c({1200}, 942);
  a.write_all(943);
  b.write_all(944);
  c.write_all(945);
  run_prefill_with(a, {300}, 96, {}, 946, false, MlaPrefillMma::kCudnn, &cudnn);
  run_prefill_with(b, {400}, 96, {}, 947, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.plans_built(), 1);
  const double first_ms = cudnn.plan_build_ms();
  run_prefill_with(c, {200}, 96, {}, 948, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.plans_built(), 2);
  EXPECT_EQ(cudnn.launches(), 3);
  std::printf("[mla prefill cudnn] plan build: the process's first %.1f ms, the next %.1f ms\n", first_ms,
              cudnn.plan_build_ms() - first_ms);
}

TEST(MlaPrefillCudnn, BatchesRoundUpToAPowerOfTwoWithEmptySequences) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // Three fresh prompts launch with batch 4 (the fourth sequence empty), four with batch 4: one plan for both, and
  // every token equal to the CPU reference (the empty entry writes nothing).
  MlaCudnnPrefill cudnn;
  PagedSequences three({100, 300, 200}, 960), four({400, 50, 130, 7}, 961);
  three.write_all(962);
  four.write_all(963);
  run_prefill_with(three, {100, 300, 200}, 96, {}, 964, false, MlaPrefillMma::kCudnn, &cudnn);
  run_prefill_with(four, {400, 50, 130, 7}, 96, {}, 965, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.plans_built(), 1);
  EXPECT_EQ(cudnn.launches(), 2);
}

TEST(MlaPrefillCudnn, BackgroundBuildsLetTheStepRunOnTheKernel) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  MlaCudnnPrefill cudnn;
  cudnn.set_background_builds(true);
  PagedSequences a({300, 120}, 970);
  a.write_all(971);
  {
    // While builds are held (a graph capture), the queued plan is not built; the step runs batchgen's own kernel.
    const std::unique_lock held = cudnn.hold_builds();
    run_prefill_with(a, {300, 120}, 96, {}, 972, false, MlaPrefillMma::kCudnn, &cudnn, false);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(cudnn.plans_built(), 0);
    EXPECT_EQ(cudnn.launches(), 0);
  }
  size_t free_before = 0, free_after = 0, total = 0;
  BG_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  cudnn.wait_for_builds();
  BG_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(cudnn.plans_built(), 1) << cudnn.last_refusal();
  std::printf("[mla prefill cudnn] a plan built on the helper thread (its own handle) in %.1f ms took %.1f MiB of "
              "device memory\n", cudnn.plan_build_ms(),
              (static_cast<double>(free_before) - static_cast<double>(free_after)) / (1 << 20));
  // Built on the helper thread with a handle of its own, run from this one.
  run_prefill_with(a, {300, 120}, 96, {}, 973, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.launches(), 1);
  // A second bucket while the first is in use.
  PagedSequences b({1500}, 974);
  b.write_all(975);
  run_prefill_with(b, {1500}, 96, {}, 976, false, MlaPrefillMma::kCudnn, &cudnn, false);
  cudnn.wait_for_builds();
  run_prefill_with(b, {1500}, 96, {}, 977, false, MlaPrefillMma::kCudnn, &cudnn);
  run_prefill_with(a, {300, 120}, 96, {}, 978, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.plans_built(), 2);
  EXPECT_EQ(cudnn.launches(), 3);
}

TEST(MlaPrefillCudnn, PlansPastTheBoundAreDroppedAndRebuilt) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // Six buckets under a bound of four: the two least recently used plans are dropped (their handles freed), every
  // step still matches the CPU reference, and a dropped bucket that comes back is rebuilt.
  MlaCudnnPrefill cudnn;
  EXPECT_THROW(cudnn.set_max_plans(MlaCudnnPrefill::kMinPlans - 1), Error);
  cudnn.set_max_plans(4);
  EXPECT_EQ(cudnn.max_plans(), 4);
  uint64_t seed = 990;
  auto step = [&](int64_t total, int64_t queries) {
    PagedSequences s({total}, seed++);
    s.write_all(seed++);
    run_prefill_with(s, {queries}, 8, {}, seed++, false, MlaPrefillMma::kCudnn, &cudnn);
  };
  for (const int64_t len : {50, 100, 200, 400, 700}) step(len, len);  // buckets 64 .. 1024 (fresh, causal)
  step(1200, 200);                                                     // q 256 after a prefix: kv 2048
  EXPECT_EQ(cudnn.plans_built(), 6) << cudnn.last_refusal();
  EXPECT_EQ(cudnn.plans_held(), 4);
  EXPECT_EQ(cudnn.plans_dropped(), 2);
  EXPECT_EQ(cudnn.launches(), 6);
  step(400, 400);  // still held: no build
  EXPECT_EQ(cudnn.plans_built(), 6);
  step(50, 50);  // dropped first: rebuilt, and another dropped for it
  EXPECT_EQ(cudnn.plans_built(), 7);
  EXPECT_EQ(cudnn.plans_held(), 4);
  EXPECT_EQ(cudnn.plans_dropped(), 3);
  cudnn.set_max_plans(MlaCudnnPrefill::kMinPlans);
  EXPECT_EQ(cudnn.launches(), 8);
}

TEST(MlaPrefillCudnn, ExactBucketsRunPlansWithoutPaddingMasks) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // Calls of one sequence that fills its buckets run exact plans (no padding mask, not ragged), each checked against
  // the CPU reference; a batch, or a length under its bucket, still takes the padded ragged plan.
  MlaCudnnPrefill cudnn;
  uint64_t seed = 1100;
  auto step = [&](std::vector<int64_t> totals, std::vector<int64_t> queries, MlaPrefillOptions options,
                  bool state) {
    PagedSequences s(std::move(totals), seed++);
    s.write_all(seed++);
    run_prefill_with(s, queries, 96, options, seed++, state, MlaPrefillMma::kCudnn, &cudnn);
  };
  step({512}, {512}, {}, false);  // one fresh prompt: causal, row >= column
  EXPECT_EQ(cudnn.exact_launches(), 1);
  step({256, 256}, {256, 256}, {}, false);  // two: a ragged batch, padded plan
  EXPECT_EQ(cudnn.exact_launches(), 1);
  step({256}, {128}, {}, false);  // a 128-token chunk after a 128-token prefix: bottom right from the lengths
  EXPECT_EQ(cudnn.exact_launches(), 2);
  // Passes of 128 rows: a fresh 64-token prompt, and a 64-token chunk after a 64-token prefix whose full piece reads
  // K and V from gathered row 64 of its pass; three exact calls of batch 1, merged through the log-sum-exp.
  step({64, 128}, {64, 64}, {2, 128}, true);
  EXPECT_EQ(cudnn.exact_launches(), 5);
  EXPECT_EQ(cudnn.launches(), 6);
  step({500}, {500}, {}, false);  // under its bucket (512): the padded plan
  EXPECT_EQ(cudnn.exact_launches(), 5);
  EXPECT_EQ(cudnn.launches(), 7);
}

TEST(MlaPrefillCudnn, ExactPlansFromTheEnvironment) {
  EXPECT_TRUE(mla_cudnn_exact_plans(nullptr));
  EXPECT_TRUE(mla_cudnn_exact_plans("1"));
  EXPECT_TRUE(mla_cudnn_exact_plans(""));
  EXPECT_FALSE(mla_cudnn_exact_plans("0"));
  for (const char* bad : {"2", "yes", "-1"}) EXPECT_THROW(mla_cudnn_exact_plans(bad), Error) << bad;
}

TEST(MlaPrefillCudnn, MaxPlansFromTheEnvironment) {
  EXPECT_EQ(mla_cudnn_max_plans(nullptr), MlaCudnnPrefill::kDefaultMaxPlans);
  EXPECT_EQ(mla_cudnn_max_plans(""), MlaCudnnPrefill::kDefaultMaxPlans);
  EXPECT_EQ(mla_cudnn_max_plans("8"), 8);
  EXPECT_EQ(mla_cudnn_max_plans("4"), 4);
  for (const char* bad : {"3", "0", "-8", "8x", "x", " 8", "99999999999999999999"}) {
    EXPECT_THROW(mla_cudnn_max_plans(bad), Error) << bad;
  }
}

TEST(MlaPrefillCudnn, K3PassesMergeThroughTheLogSumExp) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // 96 heads, passes of 512 rows: a 1300-token fresh prompt (3 passes: causal and full pieces merged) beside a 2-token
  // chunk after a 900-token prefix and a decode token.
  PagedSequences seqs({1300, 902, 40}, 950);
  seqs.write_all(951);
  run_prefill_with(seqs, {1300, 2, 1}, 96, {2, 512}, 952, true, MlaPrefillMma::kCudnn);
}

TEST(MlaPrefillCudnn, ChoiceFromTheEnvironment) {
  BG_REQUIRE_GPU();
  ::setenv("BG_MLA_PREFILL", "wgmma", 1);
  EXPECT_EQ(mla_prefill_mma_from_env(), MlaPrefillMma::kWgmma);
  ::setenv("BG_MLA_PREFILL", "mmasync", 1);
  EXPECT_EQ(mla_prefill_mma_from_env(), MlaPrefillMma::kMmaSync);
  ::setenv("BG_MLA_PREFILL", "flash", 1);
  EXPECT_THROW(mla_prefill_mma_from_env(), Error);
  ::unsetenv("BG_MLA_PREFILL");
  EXPECT_EQ(mla_prefill_mma_from_env(), MlaCudnnPrefill::built() ? MlaPrefillMma::kCudnn : MlaPrefillMma::kWgmma);
}

TEST(MlaPrefillCuda, FreshPromptMatchesCpu) {
  BG_REQUIRE_GPU();
  PagedSequences seqs({300}, 900);
  seqs.write_all(901);
  run_prefill(seqs, {300}, 16, {}, 902, false);
}

TEST(MlaPrefillCuda, PrefixPlusChunkAcrossPassesMatchesCpu) {
  BG_REQUIRE_GPU();
  // 300 new tokens after a 700-token prefix, the 1000-row context cut into passes of 192 rows: the softmax state of
  // every query tile crosses 5 pass boundaries.
  PagedSequences seqs({1000}, 910);
  seqs.write_all(911);
  run_prefill(seqs, {300}, 8, {64, 192}, 912, true);
  run_prefill(seqs, {300}, 8, {64, 16384}, 913, false);
}

TEST(MlaPrefillCuda, RaggedMixedStepMatchesCpu) {
  BG_REQUIRE_GPU();
  // Prefill pieces of 129, 64, 200 and 65 tokens (contexts 129, 64, 517, 1100) among decode tokens and a piece below
  // min_tokens (absorbed kernel), passes of 320 rows cutting sequences mid-context.
  PagedSequences seqs({129, 40, 64, 517, 30, 1100, 90}, 920);
  seqs.write_all(921);
  run_prefill(seqs, {129, 1, 64, 200, 1, 65, 63}, 12, {64, 320}, 922, true);
  // The backend's default: every piece of two or more tokens on the prefill path, the single tokens on the decode
  // kernel.
  run_prefill(seqs, {129, 1, 64, 200, 1, 65, 2}, 12, {}, 923, false);
}

TEST(MlaPrefillCuda, SmallAndOddDimsMatchCpu) {
  BG_REQUIRE_GPU();
  // The padded path: golden / random checkpoint dims, odd entries, rope 0, a misaligned cache.
  for (const auto& [d, heads, base_offset] : std::vector<std::tuple<Dims, int64_t, int64_t>>{
           {{32, 16, 16, 16, 16}, 4, 0},
           {{48, 8, 8, 24, 16}, 2, 0},
           {{37, 5, 7, 3, 5}, 3, 0},
           {{33, 0, 8, 8, 16}, 9, 0},
           {{100, 64, 64, 40, 32}, 10, 0},
           {{32, 16, 16, 16, 16}, 4, 1},
           {kProd, 8, 1}}) {
    PagedSequences seqs({150, 260}, 930 + heads, d, base_offset);
    seqs.write_all(931 + heads);
    run_prefill(seqs, {150, 100}, heads, {32, 128}, 932 + heads, true);
  }
}

TEST(MlaPrefillCuda, RejectsUntakenShapes) {
  BG_REQUIRE_GPU();
  MlaParams p{4, 2, 32, 16, 16, 16, 16, 0.1f};
  EXPECT_TRUE(mla_prefill_takes(p));
  p.qk_nope_dim = 129;
  EXPECT_FALSE(mla_prefill_takes(p));
  EXPECT_THROW(mla_prefill_workspace(p, {}), Error);
  p.qk_nope_dim = 16;
  p.qk_rope_dim = 65;
  EXPECT_FALSE(mla_prefill_takes(p));
  p.qk_rope_dim = 16;
  p.v_head_dim = 130;
  EXPECT_FALSE(mla_prefill_takes(p));
}

}  // namespace
}  // namespace bg::ops
