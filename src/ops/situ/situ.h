// SiTU GLU activation (Kimi-K3's hidden_act "situ": dense MLP, shared and routed experts), computed in fp32.
#pragma once

#include <cstdint>

namespace bg::ops {

struct SituParams {
  int64_t n_tokens = 0;   // T, may be 0
  int64_t n_inter = 0;    // I (intermediate width)
  float beta = 4.0f;      // activation_situ_beta: soft clamp of the gate branch
  float beta_lin = 25.0f; // activation_situ_linear_beta: soft clamp of the linear (up) branch
};

// out = [beta * tanh(gate / beta) * sigmoid(gate)] * [beta_lin * tanh(up / beta_lin)], elementwise.
//   gate, up, out [T, I]; out may alias gate or up.
void situ_cpu(const SituParams& p, const float* gate, const float* up, float* out);

}  // namespace bg::ops
