// Shared forward steps.
#include "model/forward_common.h"

#include "core/error.h"

namespace bg {

int64_t kv_blocks_for(int64_t max_position_embeddings, const LoadOptions& o) {
  int64_t tokens = o.max_total_tokens > 0 ? o.max_total_tokens : o.max_sequences * max_position_embeddings;
  return (tokens + o.kv_block_size - 1) / o.kv_block_size;
}

std::vector<int64_t> begin_forward(Sequence& seq, std::span<const int32_t> tokens, const ModelInfo& info) {
  const int64_t n = static_cast<int64_t>(tokens.size()), start = seq.n_past();
  BG_CHECK(start + n <= info.max_position_embeddings, "context of {} tokens exceeds max_position_embeddings {}",
           start + n, info.max_position_embeddings);
  for (int32_t id : tokens) {
    BG_CHECK(id >= 0 && id < info.vocab_size, "token id {} is outside [0, {})", id, info.vocab_size);
  }
  seq.reserve_kv(start + n);
  std::vector<int64_t> positions(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) positions[static_cast<size_t>(t)] = start + t;
  return positions;
}

void apply_route_hook(Backend& backend, const RouteHook& hook, int64_t layer, Tensor& ids, Tensor& weights) {
  if (!hook) return;
  const int64_t n = ids.rows(), k = ids.cols();
  std::vector<float> ids_f(static_cast<size_t>(n * k));
  std::vector<float> w(static_cast<size_t>(n * k));
  backend.download_f32(ids, ids_f.data());
  backend.download_f32(weights, w.data());
  std::vector<int32_t> id(ids_f.begin(), ids_f.end());
  if (!hook(layer, n, k, id, w)) return;
  BG_CHECK(static_cast<int64_t>(id.size()) == n * k && static_cast<int64_t>(w.size()) == n * k,
           "route hook: layer {} returned {} ids / {} weights for [{}, {}]", layer, id.size(), w.size(), n, k);
  backend.write_bytes(ids, std::as_bytes(std::span<const int32_t>(id)));
  backend.write_bytes(weights, std::as_bytes(std::span<const float>(w)));
}

void tap_tensor(Backend& backend, const TapFn* tap, std::string_view name, int64_t layer, const Tensor& t) {
  if (tap == nullptr) return;
  std::vector<float> host(static_cast<size_t>(t.numel()));
  backend.download_f32(t, host.data());
  (*tap)(name, layer, host.data(), t.rows(), t.cols());
}

}  // namespace bg
