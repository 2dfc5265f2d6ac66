// Where each expert of a MoE layer lives and which weights a local slot holds: the expert placement (global expert
// id -> owning rank and local slot, the same for every layer) and, per layer, the expert -> slot table in backend
// memory plus the prepared weights by slot. Kernels read the table every step, so a placement change or a streamed
// expert's arrival rewrites it in place without recapturing CUDA graphs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"

namespace bg::moe {

// Global expert id -> (rank, local slot). Every rank holds the same placement.
class ExpertPlacement {
 public:
  ExpertPlacement() = default;
  // Experts split over n_ranks in contiguous ranges of ceil(n_experts / n_ranks) (the last rank may hold fewer; every
  // rank holds at least one): rank r holds experts [r * per, min((r + 1) * per, n_experts)) in slots 0, 1, ...
  static ExpertPlacement contiguous(int64_t n_experts, int64_t n_ranks, int64_t rank);
  // An explicit placement: owner[e] is expert e's rank; slots follow expert order within each rank.
  static ExpertPlacement from_owners(std::vector<int32_t> owner, int64_t n_ranks, int64_t rank);

  int64_t n_experts() const { return static_cast<int64_t>(owner_.size()); }
  int64_t n_ranks() const { return n_ranks_; }
  int64_t rank() const { return rank_; }
  int32_t owner(int64_t expert) const { return owner_.at(static_cast<size_t>(expert)); }
  int32_t slot(int64_t expert) const { return slot_.at(static_cast<size_t>(expert)); }
  // Experts held by `rank`, in slot order.
  std::vector<int32_t> experts_of(int64_t rank) const;
  int64_t n_local() const { return static_cast<int64_t>(experts_of(rank_).size()); }
  // This rank's slot map: [n_experts] local slot, or -1 where another rank holds the expert.
  std::vector<int32_t> local_slot_map() const;

 private:
  std::vector<int32_t> owner_, slot_;
  int64_t n_ranks_ = 1, rank_ = 0;
};

// One streamed expert's bytes in host memory (valid for the model's lifetime).
struct ExpertSource {
  QuantWeight gate, up, down;
};

// The weights one slot points at.
struct ExpertHandles {
  const LinearHandle* gate = nullptr;
  const LinearHandle* up = nullptr;
  const LinearHandle* down = nullptr;
};

class ExpertStream;

// The experts of one layer that are not resident (expert_stream.h): where they stream from and through which pool.
struct StreamedExperts {
  ExpertStream* stream = nullptr;
  int64_t layer = -1;
  std::map<int32_t, ExpertSource> sources;  // global expert -> host bytes
};

// One MoE layer's experts on this rank: the device-resident expert -> slot table and the weights of each slot.
class ExpertTable {
 public:
  ExpertTable() = default;
  // all_experts: the layer's expert weights by global id (entries of other ranks may be null). Prepares this rank's
  // slots and uploads the slot map now (load time), so the first captured step finds everything in place. The
  // experts in `streamed` (this rank's, with null entries in all_experts) get the pool's placeholder weights until
  // stage() copies them in.
  ExpertTable(Backend& be, const ExpertPlacement& placement, const ExpertWeights& all_experts,
              StreamedExperts streamed = {});

  const Tensor& slot_map() const { return slot_map_; }  // I32 [n_experts]
  const ExpertSlots& slots() const { return *slots_; }
  int64_t n_slots() const { return slots_->n_slots(); }
  int64_t n_experts() const { return static_cast<int64_t>(host_map_.size()); }
  // Global expert held in `slot`.
  int32_t expert_in(int64_t slot) const { return slot_expert_.at(static_cast<size_t>(slot)); }
  // Puts `expert` in `slot` (the slot's old expert leaves this rank's map), ordered with the ops already issued.
  void assign(Backend& be, int64_t slot, int32_t expert, const LinearHandle& gate, const LinearHandle& up,
              const LinearHandle& down);

  // Streamed experts: whether any slot streams, the host bytes of a streamed expert (null when resident), and the
  // staging before the layer's experts run: every slot with rows (rows_per_slot [n_slots]) holds its expert after.
  bool streams() const { return streamed_.stream != nullptr && !streamed_.sources.empty(); }
  // Every expert has a slot on this rank (one rank).
  bool all_local() const {
    return std::none_of(host_map_.begin(), host_map_.end(), [](int32_t slot) { return slot < 0; });
  }
  const ExpertSource* source(int32_t expert) const;
  // Every streamed expert's host bytes (global expert -> source; empty when nothing streams).
  const std::map<int32_t, ExpertSource>& streamed_sources() const { return streamed_.sources; }
  void stage(Backend& be, std::span<const int32_t> rows_per_slot);
  // Points `slot` at other weights of its own expert (a stream buffer; laid_out: the same expert in the backend's
  // layout, where the layer keeps one), ordered with the ops already issued.
  void point(Backend& be, int64_t slot, const ExpertHandles& w, const Tensor* laid_out = nullptr);

 private:
  void upload_map(Backend& be);

  std::vector<int32_t> host_map_;     // [n_experts] slot or -1
  std::vector<int32_t> slot_expert_;  // [n_slots] global expert
  Tensor slot_map_;
  std::unique_ptr<ExpertSlots> slots_;
  StreamedExperts streamed_;
};

}  // namespace bg::moe
