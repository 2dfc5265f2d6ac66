// Sequence: block and slot bookkeeping over the pools.
#include "kv/sequence.h"

#include "core/error.h"

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

}  // namespace bg
