// Causal depthwise short convolution + SiLU over one sequence, carrying the last kernel_size-1 inputs across calls
// (KDA's q/k/v conv: fla ShortConvolution with activation silu, width 4, no bias).
#pragma once

#include <cstdint>

namespace bg::ops {

struct ShortConvParams {
  int64_t n_tokens = 0;     // T, may be 0
  int64_t n_channels = 0;   // C (12288 per q/k/v in K3)
  int64_t kernel_size = 4;  // W
};

// out[t][c] = silu( sum_{j<W} weight[c][j] * x_{t-(W-1)+j}[c] ), where inputs before this call's first token come
// from the conv state (and are zero for a fresh sequence: zero the state).
//   x      [T, C]
//   weight [C, W]   (the checkpoint's [C, 1, W]); weight[c][W-1] multiplies the current token
//   state  [C, W-1] in/out: state[c][j] is the input of token (first - (W-1) + j), oldest first. On return it holds
//                   the last W-1 inputs seen (old state entries shift through when T < W-1). May be null if W == 1.
//   out    [T, C]   must not alias x.
void short_conv_cpu(const ShortConvParams& p, const float* x, const float* weight, float* state, float* out);

}  // namespace bg::ops
