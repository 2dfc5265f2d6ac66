// Host-tier round trips on any backend, byte for byte, with the GPU memory the copies read reused at once: a sequence
// offloaded and restored after its blocks and slot were overwritten by another sequence, and a cached prefix evicted
// to the host tier and taken by a new request before anything waited for the copies. On CUDA the copies run on the
// copy stream (tests/cuda/state_tier_gpu_test.cpp); on the CPU they are immediate (tests/kv/state_tier_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kv/state_manager.h"

namespace bg::testing {

// 2 MLA layers of 64 + 16 values per token, 2 KDA layers of 2 heads x 16; 16-token blocks.
inline StateGeometry tier_test_geometry() {
  StateGeometry g;
  g.n_mla_layers = 2;
  g.kv_lora_rank = 64;
  g.rope_dim = 16;
  g.kda = KdaStateGeometry{2, 2, 16, 32, 4};
  g.prefill_align_tokens = 16;
  return g;
}

inline kv::StatePlan tier_test_plan(bool prefix_cache) {
  kv::StatePlan p;
  p.kv_block_tokens = 16;
  p.kv_blocks = 12;
  p.state_slots = 3;
  p.host_bytes = int64_t{8} << 20;
  p.prefix_cache = prefix_cache;
  p.snapshot_interval = 32;
  return p;
}

inline std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng() & 0x7f);  // finite whatever the dtype
  return v;
}

// Writes random bytes into every block and the slot of `seq`; returns them (blocks in order, then the slot).
inline std::vector<std::byte> fill_sequence(Backend& be, const kv::StateManager& sm, const Sequence& seq,
                                            uint64_t seed) {
  std::vector<std::byte> all;
  const int64_t block_bytes = sm.kv_pool().block_bytes();
  for (size_t i = 0; i < seq.kv_blocks().size(); ++i) {
    Tensor t = sm.kv_pool().storage().rows_view(seq.kv_blocks()[i], 1);
    std::vector<std::byte> b = random_bytes(static_cast<size_t>(block_bytes), seed + i);
    be.write_bytes(t, b);
    all.insert(all.end(), b.begin(), b.end());
  }
  if (seq.kda_slot() >= 0) {
    Tensor t = sm.state_pool().storage().rows_view(seq.kda_slot(), 1);
    std::vector<std::byte> b = random_bytes(t.nbytes(), seed + 1000);
    be.write_bytes(t, b);
    all.insert(all.end(), b.begin(), b.end());
  }
  return all;
}

// What `seq` holds now: its first n_blocks blocks, then its slot (as raw bytes, through a device -> host copy).
inline std::vector<std::byte> read_sequence(Backend& be, const kv::StateManager& sm, const Sequence& seq,
                                            size_t n_blocks) {
  std::vector<HostCopy> copies;
  const auto block_bytes = static_cast<size_t>(sm.kv_pool().block_bytes());
  const size_t slot_bytes = seq.kda_slot() >= 0 ? static_cast<size_t>(sm.state_pool().slot_bytes()) : 0;
  std::vector<std::byte> out(n_blocks * block_bytes + slot_bytes);
  for (size_t i = 0; i < n_blocks; ++i) {
    copies.push_back({sm.kv_pool().storage(), static_cast<size_t>(seq.kv_blocks()[i]) * block_bytes,
                      out.data() + i * block_bytes, block_bytes});
  }
  if (slot_bytes > 0) {
    copies.push_back({sm.state_pool().storage(), static_cast<size_t>(seq.kda_slot()) * slot_bytes,
                      out.data() + n_blocks * block_bytes, slot_bytes});
  }
  be.wait_fence(be.copy_to_host(copies));
  return out;
}

inline void offload_restore_round_trip(Backend& be) {
  kv::StateManager sm(be, tier_test_geometry(), tier_test_plan(false));
  auto a = sm.new_sequence(64);  // 4 blocks
  const std::vector<std::byte> want = fill_sequence(be, sm, *a, 1);
  a->advance(64);
  ASSERT_TRUE(sm.offload(*a));
  {  // Reuses a's blocks and slot at once: its writes must wait (on the device) for the offloading copies.
    auto b = sm.new_sequence(12 * 16);
    fill_sequence(be, sm, *b, 99);
  }
  sm.restore(*a);
  EXPECT_EQ(read_sequence(be, sm, *a, 4), want);
}

inline void prefix_offloaded_while_a_request_arrives(Backend& be) {
  kv::StateManager sm(be, tier_test_geometry(), tier_test_plan(true));
  std::vector<int32_t> tokens(40);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(3 * i + 1);
  std::vector<std::byte> want;
  {
    auto a = sm.start_sequence(tokens);  // 3 blocks, a snapshot at 32 once committed there
    want = fill_sequence(be, sm, *a, 7);
    a->advance(32);
    sm.commit(*a, tokens, 40);
  }
  ASSERT_EQ(sm.plan_start(tokens).resume_tokens, 32);
  // All 12 blocks and the free slots for another sequence: the cached blocks go to the host tier (copies issued,
  // nobody waits), the blocks are overwritten at once.
  {
    auto big = sm.new_sequence(12 * 16);
    fill_sequence(be, sm, *big, 55);
  }
  EXPECT_EQ(sm.usage().kv_blocks_cached, 0);
  EXPECT_GT(sm.usage().host_kv_bytes, 0);
  // A request with that prefix arrives before any copy was waited for: it starts from the host pages.
  auto b = sm.start_sequence(tokens);
  ASSERT_EQ(b->n_past(), 32);
  const std::vector<std::byte> got = read_sequence(be, sm, *b, 2);
  const size_t block_bytes = static_cast<size_t>(sm.kv_pool().block_bytes());
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + 2 * block_bytes, want.begin()));  // the two cached blocks
  // The slot holds the snapshot taken at 32 (a's slot at that time).
  const size_t slot_bytes = static_cast<size_t>(sm.state_pool().slot_bytes());
  EXPECT_TRUE(std::equal(got.end() - static_cast<std::ptrdiff_t>(slot_bytes), got.end(),
                         want.end() - static_cast<std::ptrdiff_t>(slot_bytes)));
}

// A compressed offload (--state-offload-dtype bf16 / fp8): the recurrent states come back within the codec's bound
// (kv/state_codec.h), the conv states (the pool's activation dtype) and the KV blocks byte for byte.
inline void compressed_offload_keeps_conv_states_exact(Backend& be, kv::StateCodec codec) {
  kv::StatePlan plan = tier_test_plan(false);
  plan.state_codec = codec;
  kv::StateManager sm(be, tier_test_geometry(), plan);
  auto a = sm.new_sequence(32);
  const KdaStateGeometry& g = sm.geometry().kda;
  const int64_t layer_words = g.layer_words(sm.state_pool().act_bytes());
  ASSERT_EQ(sm.state_pool().slot_bytes(), g.n_kda_layers * layer_words * 4);
  ASSERT_GT(layer_words, g.recurrent_floats());  // there are conv states to keep
  std::vector<std::byte> want = fill_sequence(be, sm, *a, 5);
  // Recurrent values in [-1, 1] (finite, with a spread of magnitudes) over the random bytes.
  const size_t slot0 = want.size() - static_cast<size_t>(sm.state_pool().slot_bytes());
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t l = 0; l < g.n_kda_layers; ++l) {
    for (int64_t i = 0; i < g.recurrent_floats(); ++i) {
      const float x = u(rng);
      std::memcpy(want.data() + slot0 + static_cast<size_t>((l * layer_words + i) * 4), &x, 4);
    }
  }
  Tensor slot = sm.state_pool().storage().rows_view(a->kda_slot(), 1);
  be.write_bytes(slot, std::span<const std::byte>(want).subspan(slot0));
  a->advance(32);
  ASSERT_TRUE(sm.offload(*a));
  {  // reuses a's blocks and slot
    auto b = sm.new_sequence(12 * 16);
    fill_sequence(be, sm, *b, 77);
  }
  sm.restore(*a);
  const std::vector<std::byte> got = read_sequence(be, sm, *a, 2);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(slot0), want.begin()));  // KV
  int64_t inexact = 0;
  for (int64_t l = 0; l < g.n_kda_layers; ++l) {
    const size_t layer = slot0 + static_cast<size_t>(l * layer_words * 4);
    for (int64_t i = 0; i < g.recurrent_floats(); ++i) {
      float x = 0, y = 0;
      std::memcpy(&x, want.data() + layer + static_cast<size_t>(i * 4), 4);
      std::memcpy(&y, got.data() + layer + static_cast<size_t>(i * 4), 4);
      // bf16: 2^-8 |x|; fp8: 2^-4 |x| + 2^-10 max|row| with max|row| <= 1.
      const float bound = codec == kv::StateCodec::kBF16 ? std::ldexp(std::fabs(x), -8)
                                                         : std::ldexp(std::fabs(x), -4) + std::ldexp(1.0f, -10);
      EXPECT_LE(std::fabs(y - x), bound) << "layer " << l << " value " << i;
      inexact += x != y;
    }
    const size_t conv = layer + static_cast<size_t>(g.recurrent_floats() * 4);
    const size_t conv_end = layer + static_cast<size_t>(layer_words * 4);
    EXPECT_TRUE(std::equal(got.begin() + static_cast<std::ptrdiff_t>(conv),
                           got.begin() + static_cast<std::ptrdiff_t>(conv_end),
                           want.begin() + static_cast<std::ptrdiff_t>(conv)))
        << "layer " << l << ": the conv states changed";
  }
  EXPECT_GT(inexact, 0);  // the recurrent states did go through the lossy codec
}

}  // namespace bg::testing
