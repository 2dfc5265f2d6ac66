// The shape of one sequence's state, derived once from config.json (the planner, the model and the state manager all
// read this): MLA latent KV per token for every MLA layer, and the KDA recurrent + short-conv state per sequence.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace bg {

struct KimiK3Config;
struct DeepseekV3Config;

struct KdaStateGeometry {
  int64_t n_kda_layers = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;       // K = V
  int64_t conv_channels = 0;  // n_heads * head_dim
  int64_t conv_width = 4;     // kernel size; the state keeps width - 1 inputs

  int64_t recurrent_floats() const { return n_heads * head_dim * head_dim; }
  // One of q / k / v's conv state: [conv_channels, width - 1] past conv inputs, in the backend's activation dtype
  // (act_bytes: 4 fp32 on the CPU, 2 bf16 on CUDA, where the inputs are bf16 projections: exact either way).
  int64_t conv_elems() const { return conv_channels * (conv_width - 1); }
  // The slot layout in 4-byte words: per KDA layer the fp32 recurrent state, then the three conv states, each padded
  // to 16 bytes. A slot is slot_words(act_bytes) words.
  int64_t conv_words(int64_t act_bytes) const { return (conv_elems() * act_bytes + 15) / 16 * 4; }
  int64_t layer_words(int64_t act_bytes) const { return recurrent_floats() + 3 * conv_words(act_bytes); }
  int64_t slot_words(int64_t act_bytes) const { return n_kda_layers * layer_words(act_bytes); }
  bool operator==(const KdaStateGeometry&) const = default;
};

struct StateGeometry {
  int64_t n_mla_layers = 0;
  int64_t kv_lora_rank = 0;
  int64_t rope_dim = 0;           // qk_rope_head_dim; an MLA cache entry is [c_kv | k_pe]
  KdaStateGeometry kda;           // n_kda_layers 0: no per-sequence state (DeepSeek-V3)
  // Prefill pieces start and end at multiples of this many tokens (unless a piece ends the input), so a prompt split
  // into pieces computes exactly what one prefill computes: the chunked KDA kernel works in chunks of this size from
  // the start of each call. 1 without KDA layers (every other op is per token).
  int64_t prefill_align_tokens = 1;

  int64_t entry_dim() const { return kv_lora_rank + rope_dim; }
  bool has_state() const { return kda.n_kda_layers > 0 && kda.slot_words(4) > 0; }
  // One cached token over every MLA layer, in the cache's dtype (act_bytes: 4 fp32 on the CPU, 2 bf16 on CUDA).
  int64_t kv_bytes_per_token(int64_t act_bytes) const { return n_mla_layers * entry_dim() * act_bytes; }
  // One sequence's KDA state (fp32 recurrent, conv in the activation dtype), 0 without KDA layers.
  int64_t state_bytes_per_seq(int64_t act_bytes) const { return has_state() ? kda.slot_words(act_bytes) * 4 : 0; }
  bool operator==(const StateGeometry&) const = default;
};

StateGeometry state_geometry(const DeepseekV3Config& config);
StateGeometry state_geometry(const KimiK3Config& config);

// One tensor-parallel rank's share (docs/PARALLEL.md): the KDA state of its n_heads / tp heads; the MLA latent cache
// is whole on every rank. Throws bg::Error when tp does not divide the KDA heads.
StateGeometry tp_state_geometry(const StateGeometry& g, int32_t tp);

}  // namespace bg
