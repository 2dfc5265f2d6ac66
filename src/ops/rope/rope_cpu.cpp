// RoPE tables (double precision, then rounded) and the rotation.
#include "ops/rope/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace bg::ops {
namespace {

double get_mscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

}  // namespace

RopeTable compute_rope_table(const RopeConfig& rope, int64_t rope_dim, int64_t max_position_embeddings) {
  BG_CHECK(rope_dim > 0 && rope_dim % 2 == 0, "rope: rotated dim {} must be even and positive", rope_dim);
  RopeTable t;
  int64_t half = rope_dim / 2;
  t.inv_freq.resize(static_cast<size_t>(half));
  const double base = rope.theta;
  const double dim = static_cast<double>(rope_dim);
  // transformers computes base ** (arange(0, dim, 2) / dim) in float32; the values agree to fp32 rounding.
  auto pos_freq = [&](int64_t i) { return std::pow(base, static_cast<double>(2 * i) / dim); };
  if (rope.type == "default") {
    for (int64_t i = 0; i < half; ++i) t.inv_freq[static_cast<size_t>(i)] = static_cast<float>(1.0 / pos_freq(i));
    return t;
  }
  BG_CHECK(rope.type == "yarn", "rope type '{}' is not supported", rope.type);
  double factor = rope.factor;
  double original = static_cast<double>(rope.original_max_position_embeddings);
  if (rope.original_max_position_embeddings > 0) factor = static_cast<double>(max_position_embeddings) / original;
  double attention_factor;
  if (rope.attention_factor) {
    attention_factor = *rope.attention_factor;
  } else if (rope.mscale != 0.0 && rope.mscale_all_dim != 0.0) {
    attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim);
  } else {
    attention_factor = get_mscale(factor, 1.0);
  }
  auto correction_dim = [&](double n_rot) {
    return dim * std::log(original / (n_rot * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
  };
  double low = correction_dim(rope.beta_fast), high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    double extrapolation_weight = 1.0 - ramp;
    double inv_ext = 1.0 / pos_freq(i), inv_int = 1.0 / (factor * pos_freq(i));
    t.inv_freq[static_cast<size_t>(i)] =
        static_cast<float>(inv_int * (1.0 - extrapolation_weight) + inv_ext * extrapolation_weight);
  }
  t.attention_factor = static_cast<float>(attention_factor);
  return t;
}

double yarn_softmax_scale_multiplier(const RopeConfig& rope) {
  if (rope.type == "default" || rope.mscale_all_dim == 0.0) return 1.0;
  double m = get_mscale(rope.factor, rope.mscale_all_dim);
  return m * m;
}

void apply_rope_cpu(const RopeParams& p, const RopeTable& table, const int64_t* positions, float* x) {
  int64_t half = p.rope_dim / 2;
  BG_CHECK(static_cast<int64_t>(table.inv_freq.size()) == half, "rope: table for {} dims, asked to rotate {}",
           2 * table.inv_freq.size(), p.rope_dim);
  std::vector<float> cos_v(static_cast<size_t>(half)), sin_v(static_cast<size_t>(half));
  for (int64_t t = 0; t < p.n_tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      // fp32 angle, as transformers forms position * inv_freq in float32.
      float angle = static_cast<float>(positions[t]) * table.inv_freq[static_cast<size_t>(i)];
      cos_v[static_cast<size_t>(i)] = std::cos(angle) * table.attention_factor;
      sin_v[static_cast<size_t>(i)] = std::sin(angle) * table.attention_factor;
    }
    for (int64_t h = 0; h < p.n_heads; ++h) {
      float* v = x + t * p.token_stride + h * p.head_stride + p.rope_offset;
      for (int64_t i = 0; i < half; ++i) {
        int64_t a = p.interleaved ? 2 * i : i;
        int64_t b = p.interleaved ? 2 * i + 1 : i + half;
        float x0 = v[a], x1 = v[b];
        float c = cos_v[static_cast<size_t>(i)], s = sin_v[static_cast<size_t>(i)];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
      }
    }
  }
}

}  // namespace bg::ops
