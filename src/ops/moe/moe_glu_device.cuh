// The experts' GLU on the device, shared by every MoE FFN path (skinny, tiled, grouped) so that all apply the same
// formula in fp32: SwiGLU silu(g) u, or SiTU [beta tanh(g/beta) sigmoid(g)] [beta_lin tanh(u/beta_lin)] (ops/moe/moe.h).
#pragma once

#include "ops/moe/moe.h"

namespace bg::ops {

__device__ __forceinline__ float moe_glu(float g, float u, const MoeGluParams& a) {
  const float sig = 1.0f / (1.0f + expf(-g));
  if (a.kind == MoeGlu::kSwiGlu) return g * sig * u;
  return a.beta * tanhf(g / a.beta) * sig * (a.beta_lin * tanhf(u / a.beta_lin));
}

}  // namespace bg::ops
