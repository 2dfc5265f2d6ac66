// BackendLinears: the weights' host memory pinned, then every linear prepared in batches: per layer its routed experts
// (one block per expert, expert-major) and its other linears, and the global ones.
#include "model/backend_weights.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "core/error.h"
#include "core/log.h"

namespace bg {

BackendLinears::BackendLinears(Backend& backend, const ModelWeights& weights) {
  const auto t0 = std::chrono::steady_clock::now();
  pinned_ = backend.pin_host_memory(weights.source().pinnable_regions());
  std::map<int64_t, std::vector<uint64_t>> dense, experts;  // layer -> keys in table order
  weights.for_each_linear([&](uint64_t key, const QuantWeight&) {
    (ModelWeights::key_expert(key) >= 0 ? experts : dense)[ModelWeights::key_layer(key)].push_back(key);
  });
  uint64_t bytes = 0;
  auto prepare = [&](const std::vector<uint64_t>& keys, int64_t n_experts) {
    LinearBatch batch;
    batch.n_experts = n_experts;
    for (uint64_t k : keys) {
      const QuantWeight& w = weights.linear_by_key(k);
      batch.weights.push_back(&w);
      bytes += w.data.nbytes + w.scale.nbytes;
    }
    auto handles = backend.prepare_linears(batch);
    BG_CHECK(handles.size() == keys.size(), "internal: {} handles prepared for {} weights", handles.size(), keys.size());
    for (size_t i = 0; i < keys.size(); ++i) handles_[keys[i]] = std::move(handles[i]);
  };
  for (const auto& [layer, keys] : dense) prepare(keys, 0);
  for (auto& [layer, keys] : experts) {
    // Expert-major; within an expert the table order (gate, up, down) that for_each_linear gave.
    std::stable_sort(keys.begin(), keys.end(), [](uint64_t a, uint64_t b) {
      return ModelWeights::key_expert(a) < ModelWeights::key_expert(b);
    });
    const int64_t n_experts = ModelWeights::key_expert(keys.back()) + 1;
    const bool uniform = static_cast<int64_t>(keys.size()) % n_experts == 0;
    prepare(keys, uniform ? n_experts : 0);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log::info("{}: prepared {} linear weights ({:.2f} GB) in {:.2f} s ({:.2f} GB/s)", backend.name(), handles_.size(),
            static_cast<double>(bytes) / 1e9, s, s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0.0);
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
