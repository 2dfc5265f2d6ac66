// CPU reference of the W4A16 routed-expert FFN: decoded weights (QuantWeight, the existing MXFP4 decode), dot
// products in double, GLU in fp32, h rounded to bf16 where the kernel stores it, weighted combine in slot order.
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/moe_w4a16/moe_w4a16.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops {
namespace {

// The kernel's epilogue formulas (and those of swiglu_cpu / situ_cpu).
float glu(const MoeW4a16Params& p, float g, float u) {
  if (p.act == MoeW4a16Act::kSwiGLU) return g / (1.0f + std::exp(-g)) * u;
  return p.beta * std::tanh(g / p.beta) / (1.0f + std::exp(-g)) * (p.beta_lin * std::tanh(u / p.beta_lin));
}

// QuantWeight::decode_all, parallel over rows (Kimi-K3 experts are 11M weights per matrix).
std::vector<float> decode(const QuantWeight& w) {
  std::vector<float> out(static_cast<size_t>(w.n_out * w.n_in));
  parallel_for(w.n_out, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) w.decode_row(r, out.data() + r * w.n_in);
  });
  return out;
}

double dot(const float* w, const float* x, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(w[i]) * x[i];
  return acc;
}

}  // namespace

void moe_w4a16_check_params(const MoeW4a16Params& p) {
  BG_CHECK(p.n_tokens >= 0, "moe_w4a16: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_experts > 0 && p.n_experts <= 1024, "moe_w4a16: {} experts (1..1024 supported)", p.n_experts);
  BG_CHECK(p.top_k > 0 && p.top_k <= w4::kMaxTopK && p.top_k <= p.n_experts,
           "moe_w4a16: top_k {} of {} experts (<= {})", p.top_k, p.n_experts, w4::kMaxTopK);
  BG_CHECK(p.hidden > 0 && p.inter > 0 && p.hidden % kMxfp4GroupSize == 0 && p.inter % kMxfp4GroupSize == 0,
           "moe_w4a16: hidden {} and inter {} must be positive multiples of 32", p.hidden, p.inter);
  // The kernel's item table packs an item index in 15 bits and a tile in 24 (moe_w4a16_schedule.h).
  BG_CHECK(p.hidden <= (int64_t{1} << 20) && p.inter <= (int64_t{1} << 20),
           "moe_w4a16: hidden {} and inter {} must be at most 2^20", p.hidden, p.inter);
  BG_CHECK(p.n_tokens * p.top_k <= (int64_t{1} << 30), "moe_w4a16: {} tokens x top-{} is too many rows", p.n_tokens,
           p.top_k);
  BG_CHECK(p.act != MoeW4a16Act::kSiTU || (p.beta > 0.0f && p.beta_lin > 0.0f),
           "moe_w4a16: SiTU beta {} and beta_lin {} must be positive", p.beta, p.beta_lin);
  BG_CHECK(p.fixed_splits >= 0 && p.fixed_splits <= 8, "moe_w4a16: fixed_splits {} (0 = auto, 1..8)",
           p.fixed_splits);
  BG_CHECK(!p.rows_out || (!p.out_f32 && !p.accumulate),
           "moe_w4a16: rows out writes bf16 rows (out_f32 {}, accumulate {})", p.out_f32, p.accumulate);
}

void moe_w4a16_cpu(const MoeW4a16Params& p, std::span<const MoeW4a16ExpertView> experts, const float* x,
                   const int32_t* ids, const float* weights, float* out) {
  moe_w4a16_check_params(p);
  BG_CHECK(!p.rows_out, "moe_w4a16_cpu: rows out is the case top_k = 1, weights 1 (pass it that way)");
  BG_CHECK(static_cast<int64_t>(experts.size()) == p.n_experts, "moe_w4a16_cpu: {} expert views for {} experts",
           experts.size(), p.n_experts);
  if (p.n_tokens == 0) return;
  BG_CHECK(x && ids && weights && out, "moe_w4a16_cpu: null pointer with {} tokens", p.n_tokens);
  const int64_t H = p.hidden, I = p.inter, slots = p.n_tokens * p.top_k;
  for (int64_t i = 0; i < slots; ++i) {
    BG_CHECK(ids[i] >= 0 && ids[i] < p.n_experts, "moe_w4a16_cpu: slot {} routes to expert {} of {}", i, ids[i],
             p.n_experts);
  }
  std::vector<float> y(static_cast<size_t>(slots * H));  // expert output of each (token, slot)
  for (int64_t e = 0; e < p.n_experts; ++e) {
    std::vector<int64_t> mine;
    for (int64_t i = 0; i < slots; ++i) {
      if (ids[i] == e) mine.push_back(i);
    }
    if (mine.empty()) continue;
    const MoeW4a16ExpertView& ex = experts[static_cast<size_t>(e)];
    BG_CHECK(ex.gate && ex.up && ex.down, "moe_w4a16_cpu: expert {} is missing a weight", e);
    const std::vector<float> gate = decode(*ex.gate), up = decode(*ex.up), down = decode(*ex.down);
    // Parallel over output features (any row count keeps every core busy): h [rows, I], then y rows.
    const auto n_rows = static_cast<int64_t>(mine.size());
    std::vector<float> h(static_cast<size_t>(n_rows * I));
    parallel_for(I, 16, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) {
        for (int64_t r = 0; r < n_rows; ++r) {
          const float* xt = x + (mine[static_cast<size_t>(r)] / p.top_k) * H;
          const auto g = static_cast<float>(dot(gate.data() + i * H, xt, H));
          const auto u = static_cast<float>(dot(up.data() + i * H, xt, H));
          h[static_cast<size_t>(r * I + i)] = bf16_to_f32(f32_to_bf16(glu(p, g, u)));
        }
      }
    });
    parallel_for(H, 16, [&](int64_t b, int64_t end) {
      for (int64_t o = b; o < end; ++o) {
        for (int64_t r = 0; r < n_rows; ++r) {
          const int64_t slot = mine[static_cast<size_t>(r)];
          y[static_cast<size_t>(slot * H + o)] = static_cast<float>(dot(down.data() + o * I, h.data() + r * I, I));
        }
      }
    });
  }
  // The kernel's combine: fp32, starting from out (accumulate) or 0, one fma per slot in slot order.
  for (int64_t t = 0; t < p.n_tokens; ++t) {
    for (int64_t o = 0; o < H; ++o) {
      float acc = p.accumulate ? out[t * H + o] : 0.0f;
      for (int64_t k = 0; k < p.top_k; ++k) {
        acc = std::fma(weights[t * p.top_k + k], y[static_cast<size_t>((t * p.top_k + k) * H + o)], acc);
      }
      out[t * H + o] = acc;
    }
  }
}

}  // namespace bg::ops
