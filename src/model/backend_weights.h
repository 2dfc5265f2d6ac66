// Every linear weight of a model prepared for one backend (CPU: the stored weights; CUDA: device copies made in
// batches, one device allocation per layer's experts and per layer's other linears), addressed by the same (tensor
// id, layer, expert) as ModelWeights. Holds the pinning of the weight source's memory (released before the source).
// With several ranks each rank prepares only its share: its own experts, and its tensor-parallel slice of the split
// weights (tp_shard.h).
#pragma once

#include <functional>
#include <memory>
#include <vector>
#include <unordered_map>

#include "backend/backend.h"
#include "model/arch_table.h"
#include "model/tp_shard.h"

namespace bg {

// This rank's share of a linear (empty function: every linear whole).
using ShareFn = std::function<LinearShare(int id, int64_t layer, int64_t expert)>;

class BackendLinears {
 public:
  BackendLinears(Backend& backend, const ModelWeights& weights, const ShareFn& share = {});
  const LinearHandle& get(int id, int64_t layer = -1, int64_t expert = -1) const;
  // The routed experts of one layer (gate/up/down ids) in expert order; null where another rank holds the expert.
  ExpertWeights experts(int gate_id, int up_id, int down_id, int64_t layer, int64_t n_experts) const;

 private:
  std::shared_ptr<void> pinned_;  // declared first: unpinned after the handles are gone
  std::unordered_map<uint64_t, std::unique_ptr<LinearHandle>> handles_;
  std::vector<std::shared_ptr<HostTensor>> owned_;  // copied shares the handles point into (CPU)
};

}  // namespace bg
