// KDA state slots (Kimi-K3): per slot and KDA layer, the recurrent state [heads, head_dim_k, head_dim_v] fp32 and the
// short-conv state of q, k and v [3][channels, kernel-1] in Backend::conv_state_dtype (fp32 on the CPU, bf16 on
// CUDA: the conv state holds past conv inputs, which are activations, so either is exact), in the backend's memory
// (layout: KdaStateGeometry::layer_words). Constant in length. Owned by the kv::StateManager: a slot belongs to one
// running sequence or holds one prefix-cache snapshot.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "kv/state_geometry.h"

namespace bg {

class KdaStatePool {
 public:
  KdaStatePool(Backend& backend, const KdaStateGeometry& geometry, int64_t n_slots);

  const KdaStateGeometry& geometry() const { return geometry_; }
  int64_t n_slots() const { return n_slots_; }
  int64_t n_free_slots() const { return static_cast<int64_t>(free_.size()); }
  int64_t bytes() const { return static_cast<int64_t>(storage_.nbytes()); }
  // One slot: slot s is bytes [s * slot_bytes, (s + 1) * slot_bytes) of storage().
  int64_t slot_bytes() const { return geometry_.slot_words(act_bytes_) * 4; }
  // The conv states' dtype (Backend::conv_state_dtype) and its size.
  DType conv_dtype() const { return conv_dtype_; }
  int64_t act_bytes() const { return act_bytes_; }
  const Tensor& storage() const { return storage_; }
  // A slot that no sequence owns, for the padding entries of a bucketed (CUDA graph) decode batch.
  int32_t pad_slot() const { return static_cast<int32_t>(n_slots_); }
  // Layer kda_layer's recurrent state [heads, K, V] / conv state `which` (0 q, 1 k, 2 v) [channels, width - 1] of
  // every slot, as one StateRef.
  StateRef recurrent_ref(int64_t kda_layer) const;
  StateRef conv_ref(int64_t kda_layer, int which) const;
  // Allocates a slot (zeroed when `zero`); throws when none is free. Ops issued afterwards wait for a copy that still
  // read the slot when it was freed.
  int32_t alloc_slot(bool zero = true);
  void free_slot(int32_t slot, CopyFence reading = 0);
  bool in_use(int32_t slot) const;
  // Slot `dst` = slot `src` (a device copy in stream order).
  void copy_slot(int32_t src, int32_t dst);
  // Zeroes a slot's state without handing it out (a TP follower mirrors its leader's allocations,
  // docs/PARALLEL.md); ordered with the ops already issued. Const: the slot bookkeeping does not change (the step's
  // ops write the slots' contents through the same const pool).
  void zero_slot(int32_t slot) const;
  Tensor recurrent(int32_t slot, int64_t kda_layer) const;           // [heads, K, V]
  // which: 0 q, 1 k, 2 v -> [channels, width - 1] of conv_dtype()
  Tensor conv(int32_t slot, int64_t kda_layer, int which) const;

 private:
  struct FreeSlot {
    int32_t slot;
    CopyFence reading;
  };
  Tensor layer_view(int32_t slot, int64_t kda_layer) const;  // [layer_words] fp32
  Backend& backend_;
  KdaStateGeometry geometry_;
  DType conv_dtype_;
  int64_t act_bytes_;
  int64_t n_slots_;
  Tensor storage_;  // [n_slots + 1, slot_words] fp32 words: the last slot is the padding slot
  std::vector<FreeSlot> free_;
  std::vector<uint8_t> in_use_;
};

}  // namespace bg
