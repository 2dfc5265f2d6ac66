// fabricate_sequence_context: seeded patterns uploaded once per call, copied into the sequence's blocks and slot.
#include "model/fabricate_context.h"

#include <span>
#include <vector>

#include "core/error.h"

namespace bg {
namespace {

// KV patterns per call: enough that neighbouring blocks differ, few enough that uploading them is free.
constexpr int64_t kKvPatterns = 8;

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// n values of standard deviation `std` (uniform in [-sqrt(3) std, sqrt(3) std]) from a counter hash of (seed, i):
// cheap enough for the 6.3 MB recurrent state of every KDA layer of hundreds of sequences.
std::vector<float> random_values(int64_t n, double std, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  const double half_width = std * 1.7320508075688772;
  const uint64_t key = mix(seed);
  for (size_t i = 0; i < v.size(); ++i) {
    const double u = static_cast<double>(mix(key ^ i) >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
    v[i] = static_cast<float>((2.0 * u - 1.0) * half_width);
  }
  return v;
}

void fill_kv(Backend& be, const MlaKvPool& pool, const std::vector<int32_t>& blocks, uint64_t seed) {
  const MlaCacheRef ref = pool.layer_ref(0);
  if (ref.storage.empty() || blocks.empty()) return;
  // A block of the pool: [n_layers, block_size, entry_dim] (every MLA layer's entries of those positions).
  const int64_t block_values = ref.n_layers * ref.block_size * ref.entry_dim;
  Tensor patterns = be.upload_f32(random_values(kKvPatterns * block_values, 1.0, seed), {kKvPatterns, block_values},
                                  be.act_dtype());
  for (size_t i = 0; i < blocks.size(); ++i) {
    Tensor dst = ref.storage.rows_view(blocks[i], 1);
    be.copy(patterns.rows_view(static_cast<int64_t>(mix(seed ^ i) % kKvPatterns), 1), dst);
  }
}

// dst (fp32, or the conv states' activation dtype) = seeded values, rounded to dst's dtype.
void write_random(Backend& be, Tensor dst, double std, uint64_t seed) {
  const std::vector<float> v = random_values(dst.numel(), std, seed);
  if (dst.dtype == DType::kF32) {
    be.write_bytes(dst, std::as_bytes(std::span<const float>(v)));
  } else {
    be.copy(be.upload_f32(v, dst.shape, dst.dtype), dst);
  }
}

void fill_kda(Backend& be, const KdaStatePool& pool, int32_t slot, uint64_t seed) {
  const KdaStateGeometry& g = pool.geometry();
  if (slot < 0 || g.n_kda_layers == 0) return;
  for (int64_t l = 0; l < g.n_kda_layers; ++l) {
    const uint64_t layer_seed = mix(seed ^ mix(static_cast<uint64_t>(l) + 1));
    write_random(be, pool.recurrent(slot, l), 0.05, layer_seed);
    if (g.conv_width <= 1) continue;
    for (int which = 0; which < 3; ++which) {
      write_random(be, pool.conv(slot, l, which), 1.0, layer_seed + static_cast<uint64_t>(which) + 1);
    }
  }
}

}  // namespace

void fabricate_sequence_context(kv::StateManager& state, Sequence& seq, int64_t n_tokens, uint64_t seed) {
  BG_CHECK(seq.n_past() == 0, "fabricate_context: the sequence already holds {} tokens", seq.n_past());
  BG_CHECK(n_tokens >= 0, "fabricate_context: {} tokens", n_tokens);
  if (n_tokens == 0) return;
  state.reserve(seq, n_tokens);  // throws when the pool is too small
  const StateGeometry& g = state.geometry();
  if (g.n_mla_layers > 0) fill_kv(state.backend(), state.kv_pool(), seq.kv_blocks(), seed);
  if (g.has_state()) fill_kda(state.backend(), state.state_pool(), seq.kda_slot(), seed);
  seq.advance(n_tokens);
}

}  // namespace bg
