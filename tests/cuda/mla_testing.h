// Shared by the MLA CUDA parity tests (mla_parity_test.cpp, mla_prefill_parity_test.cpp): a two-layer paged bf16
// cache with shuffled blocks (PagedSequences) and one absorbed attention launch checked against the CPU reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "cuda_testing.h"
#include "ops/mla/mla.h"
#include "ops/mla/mla_cuda.h"

namespace bg::ops::mla_testing {

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

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

inline void run_attention(PagedSequences& seqs, const AttentionCase& c, uint64_t seed) {
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

inline std::vector<size_t> all_indices(size_t n) {
  std::vector<size_t> v(n);
  std::iota(v.begin(), v.end(), size_t{0});
  return v;
}

}  // namespace bg::ops::mla_testing
