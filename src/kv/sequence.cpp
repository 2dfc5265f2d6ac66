// Sequence: block bookkeeping over the pools.
#include "kv/sequence.h"

#include "core/error.h"
#include "kv/kda_state_pool.h"

namespace bg {

Sequence::Sequence(MlaKvPool* kv_pool, KdaStatePool* kda_pool) : kv_pool_(kv_pool), kda_pool_(kda_pool) {
  if (kda_pool_ != nullptr) kda_slot_ = kda_pool_->alloc_slot();
}

Sequence::~Sequence() {
  if (kv_pool_ != nullptr) {
    for (int32_t b : kv_blocks_) kv_pool_->free_block(b);
  }
  if (kda_pool_ != nullptr && kda_slot_ >= 0) kda_pool_->free_slot(kda_slot_);
}

void Sequence::reserve_kv(int64_t n_tokens) {
  if (kv_pool_ == nullptr) return;
  int64_t need = (n_tokens + kv_pool_->block_size() - 1) / kv_pool_->block_size();
  while (static_cast<int64_t>(kv_blocks_.size()) < need) kv_blocks_.push_back(kv_pool_->alloc_block());
}

std::vector<const float*> Sequence::kv_block_ptrs(int64_t mla_layer) const {
  std::vector<const float*> out;
  out.reserve(kv_blocks_.size());
  for (int32_t b : kv_blocks_) out.push_back(kv_pool_->block_data(b, mla_layer));
  return out;
}

float* Sequence::kv_entry(int64_t mla_layer, int64_t pos) {
  int64_t bs = kv_pool_->block_size();
  BG_CHECK(pos >= 0 && pos / bs < static_cast<int64_t>(kv_blocks_.size()), "kv_entry: position {} not reserved", pos);
  return kv_pool_->block_data(kv_blocks_[static_cast<size_t>(pos / bs)], mla_layer) + (pos % bs) * kv_pool_->entry_dim();
}

}  // namespace bg
