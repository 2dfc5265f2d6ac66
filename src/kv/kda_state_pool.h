// KDA state slots (Kimi-K3): per sequence and KDA layer, the recurrent state [heads, head_dim_k, head_dim_v] fp32
// and the short-conv state of q, k and v [3][channels, kernel-1] fp32, in the backend's memory. Constant in length.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace bg {

struct KdaStateGeometry {
  int64_t n_kda_layers = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;       // K = V
  int64_t conv_channels = 0;  // n_heads * head_dim
  int64_t conv_width = 4;     // kernel size; the state keeps width - 1 inputs

  int64_t recurrent_floats() const { return n_heads * head_dim * head_dim; }
  int64_t conv_floats() const { return 3 * conv_channels * (conv_width - 1); }
  int64_t layer_floats() const { return recurrent_floats() + conv_floats(); }
  int64_t slot_floats() const { return n_kda_layers * layer_floats(); }
};

class KdaStatePool {
 public:
  KdaStatePool(Backend& backend, const KdaStateGeometry& geometry, int64_t n_slots);

  const KdaStateGeometry& geometry() const { return geometry_; }
  int64_t n_slots() const { return n_slots_; }
  int64_t n_free_slots() const { return static_cast<int64_t>(free_.size()); }
  int64_t bytes() const { return static_cast<int64_t>(storage_.nbytes()); }
  // A slot that no sequence owns, for the padding entries of a bucketed (CUDA graph) decode batch.
  int32_t pad_slot() const { return static_cast<int32_t>(n_slots_); }
  // Layer kda_layer's recurrent state [heads, K, V] / conv state `which` (0 q, 1 k, 2 v) [channels, width - 1] of
  // every slot, as one StateRef.
  StateRef recurrent_ref(int64_t kda_layer) const;
  StateRef conv_ref(int64_t kda_layer, int which) const;
  // Allocates a zeroed slot; throws when none is free.
  int32_t alloc_slot();
  void free_slot(int32_t slot);
  // Zeroes a slot's state without handing it out (a TP follower mirrors its leader's allocations,
  // docs/PARALLEL.md); ordered with the ops already issued.
  void zero_slot(int32_t slot);
  Tensor recurrent(int32_t slot, int64_t kda_layer) const;           // [heads, K, V]
  Tensor conv(int32_t slot, int64_t kda_layer, int which) const;     // which: 0 q, 1 k, 2 v -> [channels, width - 1]

 private:
  Tensor layer_view(int32_t slot, int64_t kda_layer) const;  // [layer_floats]
  Backend& backend_;
  KdaStateGeometry geometry_;
  int64_t n_slots_;
  Tensor storage_;  // [n_slots + 1, slot_floats]: the last slot is the padding slot
  std::vector<int32_t> free_;
  std::vector<uint8_t> in_use_;
};

}  // namespace bg
