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

// One group placed in a layer's batch: weights run.first .. run.first + run.count - 1, in groups[group]'s order.
struct GroupRun {
  LinearRun run;
  size_t group = 0;
};
// Reorders one layer's linear keys (ModelWeights::key) so the linears of each group whose ids are all there are
// adjacent, in the group's order, at the place of the first of them; the other keys keep their order. A linear
// belongs to the first complete group that names it; a later group naming it is incomplete, so left apart.
std::vector<GroupRun> place_linear_groups(int64_t layer, std::vector<uint64_t>& keys,
                                          const std::vector<std::vector<int>>& groups);

class BackendLinears {
 public:
  // `groups`: lists of linear ids that read the same input (e.g. a KDA layer's q, k, v, g, f_a, b). In every layer
  // that has all of a list's linears, they are prepared side by side so the backend can fuse them (LinearGroup).
  BackendLinears(Backend& backend, const ModelWeights& weights, const ShareFn& share = {},
                 const std::vector<std::vector<int>>& groups = {});
  const LinearHandle& get(int id, int64_t layer = -1, int64_t expert = -1) const;
  // The linears `ids` of `layer` as a group: fused where the backend fused the group's run (the same ids in the same
  // order as in the constructor's list), the parts alone otherwise.
  LinearGroup group(const std::vector<int>& ids, int64_t layer) const;
  // The routed experts of one layer (gate/up/down ids) in expert order; null where another rank holds the expert.
  ExpertWeights experts(int gate_id, int up_id, int down_id, int64_t layer, int64_t n_experts) const;

 private:
  std::shared_ptr<void> pinned_;  // declared first: unpinned after the handles are gone
  std::unordered_map<uint64_t, std::unique_ptr<LinearHandle>> handles_;
  struct Fused {
    std::vector<int> ids;
    std::unique_ptr<LinearHandle> handle;  // null: the backend keeps the parts apart
  };
  std::unordered_map<uint64_t, Fused> fused_;  // by the key of the group's first linear
  std::vector<std::shared_ptr<HostTensor>> owned_;  // copied shares the handles point into (CPU)
};

}  // namespace bg
