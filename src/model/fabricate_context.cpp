// fabricate_sequence_context: seeded patterns uploaded once per call, copied into the sequence's blocks and slot.
#include "model/fabricate_context.h"

#include <random>
#include <vector>

#include "core/error.h"

namespace bg {
namespace {

// Patterns per call: enough that neighbouring blocks differ, few enough that uploading them is free.
constexpr int64_t kPatterns = 8;

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// kPatterns rows of `row_values` Normal(0, std) values as a backend tensor [kPatterns, row_values] of `dtype`.
Tensor upload_patterns(Backend& be, int64_t row_values, double std, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(mix(seed));
  std::normal_distribution<float> normal(0.0f, static_cast<float>(std));
  std::vector<float> values(static_cast<size_t>(kPatterns * row_values));
  for (float& v : values) v = normal(rng);
  return be.upload_f32(values, {kPatterns, row_values}, dtype);
}

void fill_kv(Backend& be, const MlaKvPool& pool, const std::vector<int32_t>& blocks, uint64_t seed) {
  const MlaCacheRef ref = pool.layer_ref(0);
  if (ref.storage.empty() || blocks.empty()) return;
  // A block of the pool: [n_layers, block_size, entry_dim] (every MLA layer's entries of those positions).
  const int64_t block_values = ref.n_layers * ref.block_size * ref.entry_dim;
  Tensor patterns = upload_patterns(be, block_values, 1.0, be.act_dtype(), seed);
  for (size_t i = 0; i < blocks.size(); ++i) {
    Tensor dst = ref.storage.rows_view(blocks[i], 1);
    be.copy(patterns.rows_view(static_cast<int64_t>(mix(seed ^ i) % kPatterns), 1), dst);
  }
}

void fill_kda(Backend& be, const KdaStatePool& pool, int32_t slot, uint64_t seed) {
  const KdaStateGeometry& g = pool.geometry();
  if (slot < 0 || g.n_kda_layers == 0) return;
  Tensor recurrent = upload_patterns(be, g.recurrent_floats(), 0.05, DType::kF32, seed ^ 0x1234);
  Tensor conv = upload_patterns(be, g.conv_channels * (g.conv_width - 1), 1.0, DType::kF32, seed ^ 0x5678);
  for (int64_t l = 0; l < g.n_kda_layers; ++l) {
    Tensor r = pool.recurrent(slot, l);
    be.copy(recurrent.rows_view(static_cast<int64_t>(mix(seed ^ static_cast<uint64_t>(l)) % kPatterns), 1), r);
    if (g.conv_width <= 1) continue;
    for (int which = 0; which < 3; ++which) {
      Tensor c = pool.conv(slot, l, which);
      const uint64_t pick = mix(seed ^ static_cast<uint64_t>(l * 3 + which + 1)) % kPatterns;
      be.copy(conv.rows_view(static_cast<int64_t>(pick), 1), c);
    }
  }
}

}  // namespace

void fabricate_sequence_context(Backend& backend, MlaKvPool* kv_pool, KdaStatePool* kda_pool, Sequence& seq,
                                int64_t n_tokens, uint64_t seed) {
  BG_CHECK(seq.n_past() == 0, "fabricate_context: the sequence already holds {} tokens", seq.n_past());
  BG_CHECK(n_tokens >= 0, "fabricate_context: {} tokens", n_tokens);
  if (n_tokens == 0) return;
  seq.reserve_kv(n_tokens);  // throws naming the pool when it is too small
  if (kv_pool != nullptr) fill_kv(backend, *kv_pool, seq.kv_blocks(), seed);
  if (kda_pool != nullptr) fill_kda(backend, *kda_pool, seq.kda_slot(), seed);
  seq.advance(n_tokens);
}

}  // namespace bg
