// Expert placement and the per-layer expert -> slot table.
#include "moe/expert_table.h"

#include <span>

#include "core/error.h"
#include "moe/expert_stream.h"

namespace bg::moe {

ExpertPlacement ExpertPlacement::contiguous(int64_t n_experts, int64_t n_ranks, int64_t rank) {
  BG_CHECK(n_ranks >= 1 && n_ranks <= n_experts, "expert placement: {} experts cannot be spread over {} ranks "
           "(every rank needs at least one)", n_experts, n_ranks);
  const int64_t per = (n_experts + n_ranks - 1) / n_ranks;
  BG_CHECK((n_ranks - 1) * per < n_experts, "expert placement: {} experts in ranges of {} leave rank {} empty; use a "
           "rank count that divides the experts more evenly", n_experts, per, n_ranks - 1);
  std::vector<int32_t> owner(static_cast<size_t>(n_experts));
  for (int64_t e = 0; e < n_experts; ++e) owner[static_cast<size_t>(e)] = static_cast<int32_t>(e / per);
  return from_owners(std::move(owner), n_ranks, rank);
}

ExpertPlacement ExpertPlacement::from_owners(std::vector<int32_t> owner, int64_t n_ranks, int64_t rank) {
  BG_CHECK(n_ranks >= 1 && rank >= 0 && rank < n_ranks, "expert placement: rank {} of {}", rank, n_ranks);
  ExpertPlacement p;
  p.n_ranks_ = n_ranks;
  p.rank_ = rank;
  std::vector<int32_t> next(static_cast<size_t>(n_ranks), 0);
  p.slot_.resize(owner.size());
  for (size_t e = 0; e < owner.size(); ++e) {
    BG_CHECK(owner[e] >= 0 && owner[e] < n_ranks, "expert placement: expert {} on rank {} of {}", e, owner[e],
             n_ranks);
    p.slot_[e] = next[static_cast<size_t>(owner[e])]++;
  }
  for (int64_t r = 0; r < n_ranks; ++r) {
    BG_CHECK(next[static_cast<size_t>(r)] > 0, "expert placement: rank {} holds no expert", r);
  }
  p.owner_ = std::move(owner);
  return p;
}

std::vector<int32_t> ExpertPlacement::experts_of(int64_t rank) const {
  std::vector<int32_t> out;
  for (size_t e = 0; e < owner_.size(); ++e) {
    if (owner_[e] == rank) out.push_back(static_cast<int32_t>(e));
  }
  return out;  // expert order == slot order (from_owners numbers slots in expert order)
}

std::vector<int32_t> ExpertPlacement::local_slot_map() const {
  std::vector<int32_t> map(owner_.size(), -1);
  for (size_t e = 0; e < owner_.size(); ++e) {
    if (owner_[e] == rank_) map[e] = slot_[e];
  }
  return map;
}

ExpertTable::ExpertTable(Backend& be, const ExpertPlacement& placement, const ExpertWeights& all_experts,
                         StreamedExperts streamed)
    : streamed_(std::move(streamed)) {
  BG_CHECK(all_experts.size() == placement.n_experts(), "expert table: {} expert weights for a placement of {}",
           all_experts.size(), placement.n_experts());
  host_map_ = placement.local_slot_map();
  slot_expert_ = placement.experts_of(placement.rank());
  BG_CHECK(streamed_.sources.empty() || streamed_.stream != nullptr, "internal: streamed experts without a pool");
  ExpertWeights by_slot;
  for (int32_t e : slot_expert_) {
    auto i = static_cast<size_t>(e);
    if (const ExpertSource* src = source(e); src != nullptr) {
      const ExpertHandles h = streamed_.stream->placeholder();
      by_slot.gate.push_back(h.gate);
      by_slot.up.push_back(h.up);
      by_slot.down.push_back(h.down);
      by_slot.streamed_slots.push_back(true);
      by_slot.streamed_host.insert(by_slot.streamed_host.end(), {&src->gate, &src->up, &src->down});
      continue;
    }
    by_slot.streamed_slots.push_back(false);
    BG_CHECK(all_experts.gate[i] && all_experts.up[i] && all_experts.down[i],
             "expert table: expert {} belongs to rank {} but its weights were not loaded", e, placement.rank());
    by_slot.gate.push_back(all_experts.gate[i]);
    by_slot.up.push_back(all_experts.up[i]);
    by_slot.down.push_back(all_experts.down[i]);
  }
  by_slot.streamed = streams();
  slots_ = be.prepare_experts(by_slot);
  if (streams()) streamed_.stream->adopt_layout(be, *slots_);  // the pool's buffers in the layer's layout, if any
  slot_map_ = be.alloc({n_experts()}, DType::kI32);
  upload_map(be);
}

const ExpertSource* ExpertTable::source(int32_t expert) const {
  auto it = streamed_.sources.find(expert);
  return it == streamed_.sources.end() ? nullptr : &it->second;
}

void ExpertTable::stage(Backend& be, std::span<const int32_t> rows_per_slot) {
  if (!streams()) return;
  BG_CHECK(static_cast<int64_t>(rows_per_slot.size()) == n_slots(), "expert table: {} row counts for {} slots",
           rows_per_slot.size(), n_slots());
  streamed_.stream->stage(be, streamed_.layer, *this, rows_per_slot);
}

void ExpertTable::point(Backend& be, int64_t slot, const ExpertHandles& w, const Tensor* laid_out) {
  BG_CHECK(slot >= 0 && slot < n_slots(), "expert table: slot {} of {}", slot, n_slots());
  be.set_expert_slot(*slots_, slot, *w.gate, *w.up, *w.down, laid_out);
}

void ExpertTable::upload_map(Backend& be) {
  be.write_bytes(slot_map_, std::as_bytes(std::span<const int32_t>(host_map_)));
}

void ExpertTable::assign(Backend& be, int64_t slot, int32_t expert, const LinearHandle& gate, const LinearHandle& up,
                         const LinearHandle& down) {
  BG_CHECK(slot >= 0 && slot < n_slots(), "expert table: slot {} of {}", slot, n_slots());
  BG_CHECK(expert >= 0 && expert < n_experts(), "expert table: expert {} of {}", expert, n_experts());
  const int32_t old = slot_expert_[static_cast<size_t>(slot)];
  if (old != expert) {
    BG_CHECK(host_map_[static_cast<size_t>(expert)] < 0, "expert table: expert {} is already in slot {}", expert,
             host_map_[static_cast<size_t>(expert)]);
    host_map_[static_cast<size_t>(old)] = -1;
  }
  host_map_[static_cast<size_t>(expert)] = static_cast<int32_t>(slot);
  slot_expert_[static_cast<size_t>(slot)] = expert;
  be.set_expert_slot(*slots_, slot, gate, up, down);
  upload_map(be);
}

}  // namespace bg::moe
