// BackendLinears: one prepare_linear per bound weight.
#include "model/backend_weights.h"

#include "core/error.h"

namespace bg {

BackendLinears::BackendLinears(Backend& backend, const ModelWeights& weights) {
  weights.for_each_linear([&](uint64_t key, const QuantWeight& w) { handles_[key] = backend.prepare_linear(w); });
}

const LinearHandle& BackendLinears::get(int id, int64_t layer, int64_t expert) const {
  auto it = handles_.find(ModelWeights::key(id, layer, expert));
  BG_CHECK(it != handles_.end(), "internal: linear {} (layer {}, expert {}) was not prepared", id, layer, expert);
  return *it->second;
}

ExpertWeights BackendLinears::experts(int gate_id, int up_id, int down_id, int64_t layer, int64_t n_experts) const {
  ExpertWeights e;
  for (int64_t i = 0; i < n_experts; ++i) {
    e.gate.push_back(&get(gate_id, layer, i));
    e.up.push_back(&get(up_id, layer, i));
    e.down.push_back(&get(down_id, layer, i));
  }
  return e;
}

}  // namespace bg
