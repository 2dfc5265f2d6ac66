// Host side of the FP8 prefill path (moe_fp8.h): the E4M3 encoding, the layouts, and the emulation the tests hold the
// device path to.
#include "ops/moe/moe_fp8.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"

namespace bg::ops {
namespace {

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// max |v| over inputs [b0, b1) of row r of a [rows, width] matrix.
float block_amax(std::span<const float> v, int64_t width, int64_t r, int64_t b0, int64_t b1) {
  float amax = 0.0f;
  for (int64_t k = b0; k < b1; ++k) amax = std::max(amax, std::fabs(v[static_cast<size_t>(r * width + k)]));
  return amax;
}

}  // namespace

MoeFp8ExpertLayout moe_fp8_expert_layout(int64_t hidden, int64_t inter) {
  BG_CHECK(hidden > 0 && inter > 0, "moe fp8: expert widths {} / {} must be positive", hidden, inter);
  const auto H = static_cast<size_t>(hidden), I = static_cast<size_t>(inter);
  MoeFp8ExpertLayout l;
  l.gate_up = 0;
  l.down = align256(2 * I * H);
  l.gate_up_scale = l.down + align256(H * I);
  l.down_scale = l.gate_up_scale + align256(static_cast<size_t>(fp8_blocks(hidden)) * 2 * I * sizeof(float));
  l.bytes = l.down_scale + align256(static_cast<size_t>(fp8_blocks(inter)) * H * sizeof(float));
  return l;
}

std::vector<int64_t> fp8_scale_row0(const MoeGroupedPlan& plan) {
  std::vector<int64_t> r0{0};
  for (const int32_t rows : plan.rows) r0.push_back(r0.back() + fp8_padded_rows(rows));
  return r0;
}

bool fp8_y_spills(const MoeGroupedPlan& plan, size_t i) {
  BG_CHECK(i < plan.rows.size(), "moe fp8: expert {} of a plan of {}", i, plan.rows.size());
  return plan.row_begin[i] + fp8_padded_rows(plan.rows[i]) > plan.row_begin.back() + plan.rows.back();
}

MoeFp8CallLayout moe_fp8_call_layout(const MoeGroupedPlan& plan) {
  const size_t spare = kFp8RowAlign;
  const auto rows = static_cast<size_t>(plan.n_active() == 0 ? 0 : plan.row_begin.back() + plan.rows.back()) + spare;
  const auto scale_rows = static_cast<size_t>(fp8_scale_row0(plan).back());
  size_t tail_rows = 0;
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    if (fp8_y_spills(plan, i)) tail_rows = std::max(tail_rows, static_cast<size_t>(fp8_padded_rows(plan.rows[i])));
  }
  const size_t block_scales = static_cast<size_t>(std::max(fp8_blocks(plan.inter) * fp8_block_scale_ld(plan.hidden),
                                                           fp8_blocks(plan.hidden) * fp8_block_scale_ld(plan.inter)));
  const auto H = static_cast<size_t>(plan.hidden), I = static_cast<size_t>(plan.inter);
  MoeFp8CallLayout l;
  l.x = 0;
  l.x_scale = align256(rows * H);
  l.h = l.x_scale + align256(scale_rows * static_cast<size_t>(fp8_blocks(plan.hidden)) * sizeof(float));
  l.h_scale = l.h + align256(rows * I);
  l.gu = l.h_scale + align256(scale_rows * static_cast<size_t>(fp8_blocks(plan.inter)) * sizeof(float));
  l.tail = l.gu + align256((static_cast<size_t>(plan.max_group_rows) + spare) * 2 * I * 2);
  l.table = l.tail + align256(tail_rows * H * 2);
  l.block_scale = l.table + align256(2 * (static_cast<size_t>(plan.n_active()) + 1) * sizeof(int64_t));
  l.bytes = l.block_scale + align256(block_scales * sizeof(float));
  return l;
}

std::vector<float> fp8_quantize_rows_emulated(std::span<const float> x, int64_t rows, int64_t width) {
  BG_CHECK(rows >= 0 && width > 0 && x.size() == static_cast<size_t>(rows * width),
           "fp8 emulation: {} values for [{}, {}]", x.size(), rows, width);
  std::vector<float> out(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b0 = 0; b0 < width; b0 += kFp8BlockInputs) {
      const int64_t b1 = std::min(width, b0 + kFp8BlockInputs);
      const float scale = fp8_activation_scale(block_amax(x, width, r, b0, b1));
      for (int64_t k = b0; k < b1; ++k) {
        const auto i = static_cast<size_t>(r * width + k);
        out[i] = f8e4m3_to_f32(f32_to_f8e4m3(x[i] / scale)) * scale;
      }
    }
  }
  return out;
}

std::vector<float> fp8_convert_weight_emulated(std::span<const float> w, int64_t n_out, int64_t n_in,
                                               int64_t* inexact_blocks) {
  BG_CHECK(n_out >= 0 && n_in > 0 && w.size() == static_cast<size_t>(n_out * n_in),
           "fp8 emulation: {} weights for [{}, {}]", w.size(), n_out, n_in);
  std::vector<float> out(w.size());
  int64_t inexact = 0;
  for (int64_t r = 0; r < n_out; ++r) {
    for (int64_t b0 = 0; b0 < n_in; b0 += kFp8BlockInputs) {
      const int64_t b1 = std::min(n_in, b0 + kFp8BlockInputs);
      const int s = fp8_weight_scale_exponent(block_amax(w, n_in, r, b0, b1));
      bool exact = true;
      for (int64_t k = b0; k < b1; ++k) {
        const auto i = static_cast<size_t>(r * n_in + k);
        out[i] = std::ldexp(f8e4m3_to_f32(f32_to_f8e4m3(std::ldexp(w[i], -s))), s);
        exact = exact && out[i] == w[i];
      }
      inexact += exact ? 0 : 1;
    }
  }
  if (inexact_blocks != nullptr) *inexact_blocks = inexact;
  return out;
}

}  // namespace bg::ops
