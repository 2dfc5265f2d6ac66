// MLA absorbed attention over a paged latent cache against the expanded form computed here in double (k_nope = W_UK c,
// v = W_UV c per cached token, causal softmax of scale * (q_nope . k_nope + q_pe . k_pe)), over a grid of shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/mla/mla.h"

namespace bg::ops {
namespace {

struct MlaShape {
  int64_t n_heads, kv_lora, rope_dim;
};

constexpr int64_t kNope = 24, kVHead = 16, kBlock = 16, kMaxCtx = 70;

std::vector<float> normal_vector(size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

// Test data for one shape: weights, a logical cache of kMaxCtx entries, and the paged copy of it.
struct MlaFixture {
  MlaParams p;
  int64_t entry_dim = 0;
  std::vector<float> w_uk, w_uv;  // [heads, nope, lora], [heads, v, lora]
  std::vector<float> cache;       // [kMaxCtx, entry_dim], logical order
  std::vector<float> pool;        // physical blocks
  std::vector<int64_t> block_of;  // logical block -> physical block (shuffled)

  MlaFixture(const MlaShape& s, uint32_t seed) {
    p.n_heads = s.n_heads;
    p.kv_lora_rank = s.kv_lora;
    p.qk_nope_dim = kNope;
    p.qk_rope_dim = s.rope_dim;
    p.v_head_dim = kVHead;
    p.block_size = kBlock;
    p.softmax_scale = 1.3f / std::sqrt(static_cast<float>(kNope + s.rope_dim));
    entry_dim = s.kv_lora + s.rope_dim;
    std::mt19937 rng(seed);
    const float w_std = 1.0f / std::sqrt(static_cast<float>(s.kv_lora));
    w_uk = normal_vector(static_cast<size_t>(s.n_heads * kNope * s.kv_lora), w_std, rng);
    w_uv = normal_vector(static_cast<size_t>(s.n_heads * kVHead * s.kv_lora), w_std, rng);
    cache = normal_vector(static_cast<size_t>(kMaxCtx * entry_dim), 1.0f, rng);
    // 5 logical blocks (80 slots for 70 tokens) in 7 physical ones, in a scrambled order.
    block_of = {3, 0, 6, 2, 5};
    pool.assign(static_cast<size_t>(7 * kBlock * entry_dim), 0.0f);
  }

  // Pages the first n_ctx cache entries; every other slot holds NaN so that reading it poisons the output.
  std::vector<const float*> page(int64_t n_ctx) {
    std::fill(pool.begin(), pool.end(), std::numeric_limits<float>::quiet_NaN());
    for (int64_t j = 0; j < n_ctx; ++j) {
      float* dst = pool.data() + (block_of[static_cast<size_t>(j / kBlock)] * kBlock + j % kBlock) * entry_dim;
      std::copy_n(cache.data() + j * entry_dim, entry_dim, dst);
    }
    std::vector<const float*> blocks;
    for (int64_t b : block_of) blocks.push_back(pool.data() + b * kBlock * entry_dim);
    return blocks;
  }

  // Expanded attention in double for token t at position pos, head h: out [v_head].
  std::vector<double> expected(const float* qh, int64_t h, int64_t pos) const {
    const int64_t lora = p.kv_lora_rank;
    const float* uk = w_uk.data() + h * kNope * lora;
    const float* uv = w_uv.data() + h * kVHead * lora;
    std::vector<double> scores, out(static_cast<size_t>(kVHead), 0.0);
    std::vector<std::vector<double>> values;
    for (int64_t j = 0; j <= pos; ++j) {
      const float* c = cache.data() + j * entry_dim;
      double s = 0.0;
      for (int64_t i = 0; i < kNope; ++i) {
        double k_nope = 0.0;
        for (int64_t l = 0; l < lora; ++l) k_nope += static_cast<double>(uk[i * lora + l]) * c[l];
        s += qh[i] * k_nope;
      }
      for (int64_t r = 0; r < p.qk_rope_dim; ++r) s += static_cast<double>(qh[kNope + r]) * c[lora + r];
      scores.push_back(static_cast<double>(p.softmax_scale) * s);
      std::vector<double> v(static_cast<size_t>(kVHead), 0.0);
      for (int64_t d = 0; d < kVHead; ++d)
        for (int64_t l = 0; l < lora; ++l) v[static_cast<size_t>(d)] += static_cast<double>(uv[d * lora + l]) * c[l];
      values.push_back(std::move(v));
    }
    double max_s = *std::max_element(scores.begin(), scores.end()), denom = 0.0;
    for (double& s : scores) denom += (s = std::exp(s - max_s));
    for (size_t j = 0; j < scores.size(); ++j)
      for (int64_t d = 0; d < kVHead; ++d)
        out[static_cast<size_t>(d)] += scores[j] / denom * values[j][static_cast<size_t>(d)];
    return out;
  }

  // Runs the op for tokens at `positions` (cache paged up to n_ctx) and compares every head with `expected`.
  void check(const std::vector<int64_t>& positions, int64_t n_ctx, std::mt19937& rng) {
    p.n_tokens = static_cast<int64_t>(positions.size());
    const int64_t qk = kNope + p.qk_rope_dim;
    std::vector<float> q = normal_vector(static_cast<size_t>(p.n_tokens * p.n_heads * qk), 1.0f, rng);
    std::vector<float> out(static_cast<size_t>(p.n_tokens * p.n_heads * kVHead), NAN);
    std::vector<const float*> blocks = page(n_ctx);
    mla_attention_cpu(p, q.data(), w_uk.data(), w_uv.data(), blocks.data(), positions.data(), out.data());
    for (int64_t t = 0; t < p.n_tokens; ++t) {
      for (int64_t h = 0; h < p.n_heads; ++h) {
        std::vector<double> want = expected(q.data() + (t * p.n_heads + h) * qk, h, positions[static_cast<size_t>(t)]);
        double rms = 0.0;
        for (double w : want) rms += w * w;
        rms = std::sqrt(rms / static_cast<double>(kVHead));
        for (int64_t d = 0; d < kVHead; ++d) {
          double w = want[static_cast<size_t>(d)];
          float got = out[static_cast<size_t>((t * p.n_heads + h) * kVHead + d)];
          // 1e-5 relative to the element, or to the head's output RMS for elements near zero.
          ASSERT_NEAR(got, w, 1e-5 * std::max(std::abs(w), rms))
              << "heads " << p.n_heads << " lora " << p.kv_lora_rank << " rope " << p.qk_rope_dim << " ctx " << n_ctx
              << " token " << t << " pos " << positions[static_cast<size_t>(t)] << " head " << h << " dim " << d;
        }
      }
    }
  }
};

const MlaShape kShapes[] = {{1, 32, 0}, {1, 32, 16}, {1, 64, 0}, {1, 64, 16},
                            {4, 32, 0}, {4, 32, 16}, {4, 64, 0}, {4, 64, 16}};

TEST(Mla, DecodeMatchesExpandedFormEveryContextLength) {
  uint32_t seed = 1;
  for (const MlaShape& s : kShapes) {
    MlaFixture f(s, seed++);
    std::mt19937 rng(seed * 101);
    for (int64_t n_ctx = 1; n_ctx <= kMaxCtx; ++n_ctx) f.check({n_ctx - 1}, n_ctx, rng);
  }
}

TEST(Mla, PrefillChunkMatchesExpandedFormWithCausalMask) {
  uint32_t seed = 50;
  for (const MlaShape& s : kShapes) {
    MlaFixture f(s, seed++);
    std::mt19937 rng(seed * 101);
    // Nine tokens ending at the context end: each token must see only positions <= its own.
    for (int64_t n_ctx : {9, 10, 16, 17, 31, 33, 48, 63, 70}) {
      std::vector<int64_t> positions;
      for (int64_t i = 0; i < 9; ++i) positions.push_back(n_ctx - 9 + i);
      f.check(positions, n_ctx, rng);
    }
    // Nine tokens at scattered positions (different sequences' decode steps share one cache here).
    f.check({0, 69, 15, 16, 31, 32, 47, 5, 64}, kMaxCtx, rng);
  }
}

TEST(Mla, SingleEntryReturnsItsValue) {
  // With one cached token the softmax weight is 1: out = W_UV c whatever q is (here a large q).
  MlaFixture f({2, 32, 16}, 99);
  std::mt19937 rng(5);
  f.check({0}, 1, rng);
  std::vector<float> q(static_cast<size_t>(2 * (kNope + 16)), 100.0f), out(static_cast<size_t>(2 * kVHead));
  std::vector<const float*> blocks = f.page(1);
  const int64_t pos = 0;
  f.p.n_tokens = 1;
  mla_attention_cpu(f.p, q.data(), f.w_uk.data(), f.w_uv.data(), blocks.data(), &pos, out.data());
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t d = 0; d < kVHead; ++d) {
      double v = 0.0;
      for (int64_t l = 0; l < 32; ++l)
        v += static_cast<double>(f.w_uv[static_cast<size_t>((h * kVHead + d) * 32 + l)]) *
             f.cache[static_cast<size_t>(l)];
      EXPECT_NEAR(out[static_cast<size_t>(h * kVHead + d)], v, 1e-5 * std::max(1.0, std::abs(v)));
    }
  }
}

TEST(Mla, RejectsBadParams) {
  MlaParams p;
  p.n_tokens = 1;
  float x = 0.0f;
  const float* blocks[1] = {&x};
  const int64_t pos = 0;
  EXPECT_THROW(mla_attention_cpu(p, &x, &x, &x, blocks, &pos, &x), Error);
  p.n_heads = 1;
  p.kv_lora_rank = 4;
  EXPECT_THROW(mla_attention_cpu(p, &x, &x, &x, blocks, &pos, &x), Error);  // block_size 0
}

}  // namespace
}  // namespace bg::ops
