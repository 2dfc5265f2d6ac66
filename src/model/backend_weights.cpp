// BackendLinears: one prepare_linear per bound weight.
#include "model/backend_weights.h"

#include "core/error.h"
#include "core/log.h"

namespace bg {

BackendLinears::BackendLinears(Backend& backend, const ModelWeights& weights, const ShareFn& share) {
  int64_t n_dequantized = 0;
  weights.for_each_linear([&](uint64_t key, const QuantWeight& w) {
    const ModelWeights::KeyParts k = ModelWeights::split_key(key);
    const LinearShare s = share ? share(k.id, k.layer, k.expert) : LinearShare{};
    if (s.kind == ShareKind::kSkip) return;
    SharedWeight part = share_linear(w, s);
    handles_[key] = backend.prepare_linear(part.w);
    n_dequantized += part.dequantized ? 1 : 0;
    owned_.insert(owned_.end(), part.storage.begin(), part.storage.end());
  });
  if (n_dequantized > 0) {
    log::warn("{} tensor-parallel weight shares cut through FP8/MXFP4 blocks and are held dequantized (fp32)",
              n_dequantized);
  }
}

const LinearHandle& BackendLinears::get(int id, int64_t layer, int64_t expert) const {
  auto it = handles_.find(ModelWeights::key(id, layer, expert));
  BG_CHECK(it != handles_.end(), "internal: linear {} (layer {}, expert {}) was not prepared", id, layer, expert);
  return *it->second;
}

ExpertWeights BackendLinears::experts(int gate_id, int up_id, int down_id, int64_t layer, int64_t n_experts) const {
  ExpertWeights e;
  for (int64_t i = 0; i < n_experts; ++i) {
    auto find = [&](int id) -> const LinearHandle* {
      auto it = handles_.find(ModelWeights::key(id, layer, i));
      return it == handles_.end() ? nullptr : it->second.get();
    };
    e.gate.push_back(find(gate_id));
    e.up.push_back(find(up_id));
    e.down.push_back(find(down_id));
  }
  return e;
}

}  // namespace bg
