// KdaStatePool: slots in one backend allocation.
#include "kv/kda_state_pool.h"

#include "core/error.h"

namespace bg {

KdaStatePool::KdaStatePool(Backend& backend, const KdaStateGeometry& geometry, int64_t n_slots)
    : backend_(backend),
      geometry_(geometry),
      conv_dtype_(backend.conv_state_dtype()),
      act_bytes_(static_cast<int64_t>(dtype_size_bytes(conv_dtype_))),
      n_slots_(n_slots) {
  BG_CHECK(n_slots >= 0 && geometry.conv_width >= 1, "KdaStatePool: bad geometry");
  const int64_t words = geometry.slot_words(act_bytes_);
  if (n_slots > 0 && words > 0) storage_ = backend.zeros({n_slots + 1, words}, DType::kF32);
  in_use_.assign(static_cast<size_t>(n_slots), 0);
  for (int64_t s = n_slots - 1; s >= 0; --s) free_.push_back({static_cast<int32_t>(s), 0});
}

int32_t KdaStatePool::alloc_slot(bool zero) {
  BG_CHECK(!free_.empty(), "KDA state pool is full: all {} slots are in use", n_slots_);
  const FreeSlot f = free_.back();
  free_.pop_back();
  if (f.reading != 0) backend_.compute_wait(f.reading);
  in_use_[static_cast<size_t>(f.slot)] = 1;
  if (zero) zero_slot(f.slot);
  return f.slot;
}

void KdaStatePool::zero_slot(int32_t slot) const {
  BG_CHECK(slot >= 0 && slot <= n_slots_, "KdaStatePool: slot {} of {}", slot, n_slots_);
  if (storage_.empty()) return;
  Tensor t = storage_.rows_view(slot, 1);
  backend_.fill_zero(t);
}

void KdaStatePool::free_slot(int32_t slot, CopyFence reading) {
  BG_CHECK(in_use(slot), "KdaStatePool: freeing slot {} that is not in use", slot);
  in_use_[static_cast<size_t>(slot)] = 0;
  free_.push_back({slot, reading});
}

bool KdaStatePool::in_use(int32_t slot) const {
  return slot >= 0 && slot < n_slots_ && in_use_[static_cast<size_t>(slot)] != 0;
}

void KdaStatePool::copy_slot(int32_t src, int32_t dst) {
  BG_CHECK(in_use(src) && in_use(dst) && src != dst, "KdaStatePool: copying slot {} into {}", src, dst);
  if (storage_.empty()) return;
  Tensor to = storage_.rows_view(dst, 1);
  backend_.copy(storage_.rows_view(src, 1), to);
}

Tensor KdaStatePool::layer_view(int32_t slot, int64_t kda_layer) const {
  const KdaStateGeometry& g = geometry_;
  const int64_t words = g.layer_words(act_bytes_);
  Tensor t = storage_.rows_view(slot, 1).reshaped({g.n_kda_layers, words}).rows_view(kda_layer, 1);
  return t.reshaped({words});
}

StateRef KdaStatePool::recurrent_ref(int64_t kda_layer) const {
  return {storage_, kda_layer * geometry_.layer_words(act_bytes_), geometry_.slot_words(act_bytes_)};
}

StateRef KdaStatePool::conv_ref(int64_t kda_layer, int which) const {
  const KdaStateGeometry& g = geometry_;
  return {storage_, kda_layer * g.layer_words(act_bytes_) + g.recurrent_floats() + which * g.conv_words(act_bytes_),
          g.slot_words(act_bytes_)};
}

Tensor KdaStatePool::recurrent(int32_t slot, int64_t kda_layer) const {
  const KdaStateGeometry& g = geometry_;
  Tensor t = layer_view(slot, kda_layer);
  t.shape = {g.n_heads, g.head_dim, g.head_dim};
  return t;
}

Tensor KdaStatePool::conv(int32_t slot, int64_t kda_layer, int which) const {
  const KdaStateGeometry& g = geometry_;
  Tensor t = layer_view(slot, kda_layer);
  t.data = t.as<float>() + g.recurrent_floats() + which * g.conv_words(act_bytes_);
  t.dtype = conv_dtype_;
  t.shape = {g.conv_channels, g.conv_width - 1};
  return t;
}

}  // namespace bg
