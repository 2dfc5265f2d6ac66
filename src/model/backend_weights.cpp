// BackendLinears: the weights' host memory pinned, then every linear prepared in batches: per layer its routed experts
// (one block per expert, expert-major) and its other linears, and the global ones.
#include "model/backend_weights.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <set>

#include "core/error.h"
#include "core/log.h"

namespace bg {

std::vector<GroupRun> place_linear_groups(int64_t layer, std::vector<uint64_t>& keys,
                                          const std::vector<std::vector<int>>& groups) {
  std::unordered_map<uint64_t, size_t> group_of;  // member key -> its group (complete groups only)
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const std::vector<int>& ids = groups[gi];
    const std::set<int> distinct(ids.begin(), ids.end());
    const bool complete = ids.size() >= 2 && distinct.size() == ids.size() &&
                          std::all_of(ids.begin(), ids.end(), [&](int id) {
                            const uint64_t k = ModelWeights::key(id, layer, -1);
                            return std::find(keys.begin(), keys.end(), k) != keys.end() && !group_of.contains(k);
                          });
    if (!complete) continue;
    for (int id : ids) group_of[ModelWeights::key(id, layer, -1)] = gi;
  }
  std::vector<GroupRun> runs;
  std::vector<uint64_t> placed;
  std::vector<bool> done(groups.size(), false);
  for (uint64_t k : keys) {
    auto it = group_of.find(k);
    if (it == group_of.end()) {
      placed.push_back(k);
      continue;
    }
    if (done[it->second]) continue;
    done[it->second] = true;
    runs.push_back({{placed.size(), groups[it->second].size()}, it->second});
    for (int id : groups[it->second]) placed.push_back(ModelWeights::key(id, layer, -1));
  }
  keys = std::move(placed);
  return runs;
}

BackendLinears::BackendLinears(Backend& backend, const ModelWeights& weights, const ShareFn& share,
                               const std::vector<std::vector<int>>& groups) {
  const auto t0 = std::chrono::steady_clock::now();
  pinned_ = backend.pin_host_memory(weights.source().pinnable_regions());
  // This rank's share of each linear: skipped (another rank's expert), whole (the stored weight, pinned memory), or
  // a tensor-parallel slice (a copy kept in owned_ for the CPU handles that point into it).
  std::map<int64_t, std::vector<uint64_t>> dense, experts;  // layer -> keys in table order
  std::unordered_map<uint64_t, SharedWeight> parts;           // keys whose share is a slice
  int64_t n_dequantized = 0;
  weights.for_each_linear([&](uint64_t key, const QuantWeight& w) {
    const ModelWeights::KeyParts k = ModelWeights::split_key(key);
    const LinearShare s = share ? share(k.id, k.layer, k.expert) : LinearShare{};
    if (s.kind == ShareKind::kSkip) return;
    if (s.kind != ShareKind::kAll) {
      SharedWeight part = share_linear(w.resolved(), s);  // a slice reads the bytes (a deferred expert's unpacked)
      n_dequantized += part.dequantized ? 1 : 0;
      parts.emplace(key, std::move(part));
    }
    (k.expert >= 0 ? experts : dense)[k.layer].push_back(key);
  });
  if (n_dequantized > 0) {
    log::warn("{} tensor-parallel weight shares cut through FP8/MXFP4 blocks and are held dequantized (fp32)",
              n_dequantized);
  }
  uint64_t bytes = 0;
  auto prepare = [&](const std::vector<uint64_t>& keys, int64_t n_experts, const std::vector<GroupRun>& runs) {
    LinearBatch batch;
    batch.n_experts = n_experts;
    for (const GroupRun& r : runs) batch.runs.push_back(r.run);
    std::deque<QuantWeight> resolved;  // this rank's deferred experts' checkpoint bytes, for a backend that needs them
    for (uint64_t k : keys) {
      auto it = parts.find(k);
      const QuantWeight* w = it != parts.end() ? &it->second.w : &weights.linear_by_key(k);
      if (w->deferred() && !backend.takes_deferred_experts()) {
        resolved.push_back(w->resolved());
        w = &resolved.back();
      }
      batch.weights.push_back(w);
      bytes += w->data.nbytes + w->scale.nbytes;
    }
    PreparedLinears prepared = backend.prepare_linears(batch);
    auto& handles = prepared.weights;
    BG_CHECK(handles.size() == keys.size() && prepared.runs.size() == runs.size(), "internal: {} handles and {} runs "
             "prepared for {} weights and {} runs", handles.size(), prepared.runs.size(), keys.size(), runs.size());
    for (size_t i = 0; i < keys.size(); ++i) handles_[keys[i]] = std::move(handles[i]);
    for (size_t i = 0; i < runs.size(); ++i) {
      fused_[keys[runs[i].run.first]] = {groups[runs[i].group], std::move(prepared.runs[i])};
    }
  };
  for (auto& [layer, keys] : dense) {
    prepare(keys, 0, place_linear_groups(layer, keys, groups));
  }
  for (auto& [layer, keys] : experts) {
    // Expert-major; within an expert the table order (gate, up, down) that for_each_linear gave. With expert
    // parallelism the batch holds only this rank's experts, so it counts the experts present, not the highest id.
    std::stable_sort(keys.begin(), keys.end(), [](uint64_t a, uint64_t b) {
      return ModelWeights::key_expert(a) < ModelWeights::key_expert(b);
    });
    int64_t n_experts = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i == 0 || ModelWeights::key_expert(keys[i]) != ModelWeights::key_expert(keys[i - 1])) ++n_experts;
    }
    const bool uniform = static_cast<int64_t>(keys.size()) % n_experts == 0;
    prepare(keys, uniform ? n_experts : 0, {});
  }
  // The CPU handles view the slices' storage: keep it for the handles' lifetime.
  for (auto& [key, part] : parts) owned_.insert(owned_.end(), part.storage.begin(), part.storage.end());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log::info("{}: prepared {} linear weights ({:.2f} GB) in {:.2f} s ({:.2f} GB/s)", backend.name(), handles_.size(),
            static_cast<double>(bytes) / 1e9, s, s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0.0);
}

const LinearHandle& BackendLinears::get(int id, int64_t layer, int64_t expert) const {
  auto it = handles_.find(ModelWeights::key(id, layer, expert));
  BG_CHECK(it != handles_.end(), "internal: linear {} (layer {}, expert {}) was not prepared", id, layer, expert);
  return *it->second;
}

LinearGroup BackendLinears::group(const std::vector<int>& ids, int64_t layer) const {
  LinearGroup g;
  for (int id : ids) g.parts.push_back(&get(id, layer));
  if (ids.empty()) return g;
  auto it = fused_.find(ModelWeights::key(ids.front(), layer, -1));
  if (it != fused_.end() && it->second.ids == ids) g.fused = it->second.handle.get();
  return g;
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
