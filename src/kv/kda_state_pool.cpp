// KdaStatePool: slots in one allocation, zeroed on allocation.
#include "kv/kda_state_pool.h"

#include <algorithm>

#include "core/error.h"

namespace bg {

KdaStatePool::KdaStatePool(const KdaStateGeometry& geometry, int64_t n_slots)
    : geometry_(geometry), n_slots_(n_slots) {
  BG_CHECK(n_slots >= 0 && geometry.conv_width >= 1, "KdaStatePool: bad geometry");
  storage_.assign(static_cast<size_t>(n_slots * geometry.slot_floats()), 0.0f);
  in_use_.assign(static_cast<size_t>(n_slots), 0);
  for (int64_t s = n_slots - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
}

int32_t KdaStatePool::alloc_slot() {
  BG_CHECK(!free_.empty(), "KDA state pool is full: all {} slots are in use", n_slots_);
  int32_t s = free_.back();
  free_.pop_back();
  in_use_[static_cast<size_t>(s)] = 1;
  float* base = slot_base(s);
  std::fill(base, base + geometry_.slot_floats(), 0.0f);
  return s;
}

void KdaStatePool::free_slot(int32_t slot) {
  BG_CHECK(slot >= 0 && slot < n_slots_ && in_use_[static_cast<size_t>(slot)], "KdaStatePool: freeing slot {} that "
           "is not in use", slot);
  in_use_[static_cast<size_t>(slot)] = 0;
  free_.push_back(slot);
}

float* KdaStatePool::slot_base(int32_t slot) { return storage_.data() + slot * geometry_.slot_floats(); }

float* KdaStatePool::recurrent(int32_t slot, int64_t kda_layer) {
  return slot_base(slot) + kda_layer * (geometry_.recurrent_floats() + geometry_.conv_floats());
}

float* KdaStatePool::conv(int32_t slot, int64_t kda_layer) {
  return recurrent(slot, kda_layer) + geometry_.recurrent_floats();
}

}  // namespace bg
