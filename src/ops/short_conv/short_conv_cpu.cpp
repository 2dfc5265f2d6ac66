// CPU reference for the causal depthwise short conv + SiLU (fp32), parallel over tokens; then the state shift.
#include "ops/short_conv/short_conv.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/thread_pool.h"

namespace bg::ops {
namespace {

float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Input of token s (relative to this call's first token; s >= -(W-1)) for channel c: x, or the state when s < 0.
float input_at(const ShortConvParams& p, const float* x, const float* state, int64_t s, int64_t c) {
  const int64_t n_hist = p.kernel_size - 1;
  return s >= 0 ? x[s * p.n_channels + c] : state[c * n_hist + n_hist + s];
}

// Output rows [t_begin, t_end). Tokens with their whole window inside x take the plain path.
void conv_tokens(const ShortConvParams& p, const float* x, const float* weight, const float* state, float* out,
                 int64_t t_begin, int64_t t_end) {
  const int64_t w = p.kernel_size;
  const int64_t n_ch = p.n_channels;
  for (int64_t t = t_begin; t < t_end; ++t) {
    float* ot = out + t * n_ch;
    const int64_t first = t - (w - 1);  // token of weight column 0
    if (first >= 0) {
      for (int64_t c = 0; c < n_ch; ++c) {
        const float* wc = weight + c * w;
        float acc = 0.0f;
        for (int64_t j = 0; j < w; ++j) acc += wc[j] * x[(first + j) * n_ch + c];
        ot[c] = silu(acc);
      }
    } else {
      for (int64_t c = 0; c < n_ch; ++c) {
        const float* wc = weight + c * w;
        float acc = 0.0f;
        for (int64_t j = 0; j < w; ++j) acc += wc[j] * input_at(p, x, state, first + j, c);
        ot[c] = silu(acc);
      }
    }
  }
}

}  // namespace

void short_conv_cpu(const ShortConvParams& p, const float* x, const float* weight, float* state, float* out) {
  BG_CHECK(p.n_tokens >= 0, "short_conv_cpu: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_channels > 0, "short_conv_cpu: n_channels {} must be positive", p.n_channels);
  BG_CHECK(p.kernel_size >= 1 && p.kernel_size <= 64, "short_conv_cpu: kernel_size {} outside [1, 64]",
           p.kernel_size);
  const int64_t n_hist = p.kernel_size - 1;
  BG_CHECK(state != nullptr || n_hist == 0, "short_conv_cpu: state is null with kernel_size {}", p.kernel_size);
  if (p.n_tokens == 0) return;
  BG_CHECK(x && weight && out, "short_conv_cpu: null x/weight/out with n_tokens {}", p.n_tokens);
  BG_CHECK(out != x, "short_conv_cpu: out aliases x");

  const int64_t grain = std::max<int64_t>(1, 16384 / p.n_channels);
  parallel_for(p.n_tokens, grain, [&](int64_t t_begin, int64_t t_end) {
    conv_tokens(p, x, weight, state, out, t_begin, t_end);
  });

  // New state: the inputs of tokens T-(W-1) .. T-1. In place is safe: entry j reads old entry T+j >= j.
  for (int64_t c = 0; c < p.n_channels; ++c) {
    for (int64_t j = 0; j < n_hist; ++j) state[c * n_hist + j] = input_at(p, x, state, p.n_tokens - n_hist + j, c);
  }
}

}  // namespace bg::ops
