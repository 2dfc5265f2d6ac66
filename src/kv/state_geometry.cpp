// StateGeometry from the parsed configs: the one place where layer counts and state sizes are derived.
#include "kv/state_geometry.h"

#include <algorithm>

#include "core/error.h"
#include "formats/kimi_k3_config.h"
#include "formats/model_config.h"
#include "ops/kda/kda.h"

namespace bg {

StateGeometry state_geometry(const DeepseekV3Config& c) {
  StateGeometry g;
  g.n_mla_layers = c.n_layers;
  g.kv_lora_rank = c.kv_lora_rank;
  g.rope_dim = c.qk_rope_head_dim;
  return g;
}

StateGeometry state_geometry(const KimiK3Config& c) {
  StateGeometry g;
  g.n_mla_layers = std::count(c.layer_kinds.begin(), c.layer_kinds.end(), K3LayerKind::kMla);
  g.kv_lora_rank = c.kv_lora_rank;
  g.rope_dim = c.qk_rope_head_dim;
  g.kda = {c.n_layers - g.n_mla_layers, c.kda_heads, c.kda_head_dim, c.kda_proj_dim(), c.conv_kernel};
  if (g.has_state()) g.prefill_align_tokens = ops::kKdaDefaultChunkSize;
  return g;
}

StateGeometry tp_state_geometry(const StateGeometry& g, int32_t tp) {
  BG_CHECK(tp >= 1 && g.kda.n_heads % tp == 0, "--tp {} does not divide the {} KDA heads", tp, g.kda.n_heads);
  StateGeometry s = g;
  s.kda.n_heads /= tp;
  s.kda.conv_channels /= tp;
  return s;
}

}  // namespace bg
