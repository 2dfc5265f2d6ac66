// Every linear weight of a model prepared for one backend (CPU: the stored weights; CUDA: device copies), addressed
// by the same (tensor id, layer, expert) as ModelWeights.
#pragma once

#include <memory>
#include <unordered_map>

#include "backend/backend.h"
#include "model/arch_table.h"

namespace bg {

class BackendLinears {
 public:
  BackendLinears(Backend& backend, const ModelWeights& weights);
  const LinearHandle& get(int id, int64_t layer = -1, int64_t expert = -1) const;
  // The routed experts of one layer (gate/up/down ids) in expert order.
  ExpertWeights experts(int gate_id, int up_id, int down_id, int64_t layer, int64_t n_experts) const;

 private:
  std::unordered_map<uint64_t, std::unique_ptr<LinearHandle>> handles_;
};

}  // namespace bg
