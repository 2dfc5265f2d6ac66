// KDA: chunked vs recurrent (both fp32) vs a float64 recurrent reference, over a grid of shapes with K3-like decays,
// split calls, chunk sizes, extreme decays, a hand-computed case and parameter checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/kda/kda.h"

namespace bg::ops {
namespace {

// How the per-channel log decays g = -5 * sigmoid(x) are spread.
enum class Decay {
  kStrong,  // x ~ N(2, 2): most channels near -5 (a ~ e^-5), the chunk-cumsum reaches ~ -320
  kTiny,    // x ~ N(-9, 1): g ~ -5e-4, almost no forgetting
  kMixed,   // x ~ N(0, 4): anything from -5 to ~ -1e-6
};

struct KdaCase {
  int64_t n_tokens, n_heads, dim_k, dim_v;
  Decay decay;
};

struct KdaInputs {
  KdaParams p;
  std::vector<float> q, k, v, g, beta, state;  // state: the initial state [H, K, V]
};

struct KdaResult {
  std::vector<float> out, state;
};

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Normalises each [dim] row of x to unit L2 norm, times scale.
void normalize_rows(std::vector<float>& x, int64_t dim, float scale) {
  for (size_t r = 0; r < x.size(); r += dim) {
    float ss = 0.0f;
    for (int64_t d = 0; d < dim; ++d) ss += x[r + d] * x[r + d];
    const float inv = scale / std::sqrt(ss + 1e-6f);
    for (int64_t d = 0; d < dim; ++d) x[r + d] *= inv;
  }
}

KdaInputs make_inputs(const KdaCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](int64_t n, float mean, float sd) {
    std::vector<float> x(n);
    for (auto& e : x) e = mean + sd * normal(rng);
    return x;
  };
  KdaInputs in;
  in.p = {c.n_tokens, c.n_heads, c.dim_k, c.dim_v};
  const int64_t n_qk = c.n_tokens * c.n_heads * c.dim_k;
  in.q = fill(n_qk, 0.0f, 1.0f);
  in.k = fill(n_qk, 0.0f, 1.0f);
  normalize_rows(in.q, c.dim_k, 1.0f / std::sqrt(static_cast<float>(c.dim_k)));
  normalize_rows(in.k, c.dim_k, 1.0f);
  in.v = fill(c.n_tokens * c.n_heads * c.dim_v, 0.0f, 1.0f);
  const float mean = c.decay == Decay::kStrong ? 2.0f : (c.decay == Decay::kTiny ? -9.0f : 0.0f);
  const float sd = c.decay == Decay::kStrong ? 2.0f : (c.decay == Decay::kTiny ? 1.0f : 4.0f);
  in.g = fill(n_qk, mean, sd);
  for (auto& e : in.g) e = -5.0f * sigmoid(e);
  in.beta = fill(c.n_tokens * c.n_heads, 0.0f, 1.5f);
  for (auto& e : in.beta) e = sigmoid(e);
  in.state = fill(c.n_heads * c.dim_k * c.dim_v, 0.0f, 0.5f);
  return in;
}

// The plain recurrence in float64, straight from the formulas.
void reference_f64(const KdaInputs& in, std::vector<double>& state, std::vector<double>& out) {
  const auto& p = in.p;
  const int64_t dk = p.head_dim_k, dv = p.head_dim_v;
  state.assign(in.state.begin(), in.state.end());
  out.assign(p.n_tokens * p.n_heads * dv, 0.0);
  std::vector<double> u(dv);
  for (int64_t t = 0; t < p.n_tokens; ++t) {
    for (int64_t h = 0; h < p.n_heads; ++h) {
      double* s = state.data() + h * dk * dv;
      const int64_t qk_off = (t * p.n_heads + h) * dk, v_off = (t * p.n_heads + h) * dv;
      for (int64_t d = 0; d < dk; ++d) {
        for (int64_t j = 0; j < dv; ++j) s[d * dv + j] *= std::exp(static_cast<double>(in.g[qk_off + d]));
      }
      for (int64_t j = 0; j < dv; ++j) {
        double sk = 0.0;
        for (int64_t d = 0; d < dk; ++d) sk += s[d * dv + j] * in.k[qk_off + d];
        u[j] = in.v[v_off + j] - sk;
      }
      const double b = in.beta[t * p.n_heads + h];
      for (int64_t d = 0; d < dk; ++d) {
        for (int64_t j = 0; j < dv; ++j) s[d * dv + j] += b * in.k[qk_off + d] * u[j];
      }
      for (int64_t j = 0; j < dv; ++j) {
        double o = 0.0;
        for (int64_t d = 0; d < dk; ++d) o += s[d * dv + j] * in.q[qk_off + d];
        out[v_off + j] = o;
      }
    }
  }
}

// max |a - b| / max |b|.
template <typename T>
double rel_err(const std::vector<float>& a, const std::vector<T>& b) {
  EXPECT_EQ(a.size(), b.size());
  double max_diff = 0.0, max_ref = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double ref = static_cast<double>(b[i]);
    if (!std::isfinite(a[i])) return INFINITY;
    max_diff = std::max(max_diff, std::abs(static_cast<double>(a[i]) - ref));
    max_ref = std::max(max_ref, std::abs(ref));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

enum class Algo { kRecurrent, kChunked };

// Runs tokens [t_begin, t_end) of `in` with `algo`, continuing from and updating r.state, writing r.out.
void run_range(const KdaInputs& in, Algo algo, int64_t t_begin, int64_t t_end, KdaResult& r, int64_t chunk = 64) {
  const auto& p = in.p;
  KdaParams sub = p;
  sub.n_tokens = t_end - t_begin;
  const int64_t qk = t_begin * p.n_heads * p.head_dim_k, vo = t_begin * p.n_heads * p.head_dim_v;
  const int64_t bo = t_begin * p.n_heads;
  if (algo == Algo::kRecurrent) {
    kda_recurrent_cpu(sub, in.q.data() + qk, in.k.data() + qk, in.v.data() + vo, in.g.data() + qk,
                      in.beta.data() + bo, r.state.data(), r.out.data() + vo);
  } else {
    kda_chunked_cpu(sub, in.q.data() + qk, in.k.data() + qk, in.v.data() + vo, in.g.data() + qk,
                    in.beta.data() + bo, r.state.data(), r.out.data() + vo, chunk);
  }
}

KdaResult run(const KdaInputs& in, Algo algo, int64_t chunk = 64) {
  KdaResult r{std::vector<float>(in.p.n_tokens * in.p.n_heads * in.p.head_dim_v, NAN), in.state};
  run_range(in, algo, 0, in.p.n_tokens, r, chunk);
  return r;
}

TEST(Kda, ChunkedMatchesRecurrentAndFloat64Reference) {
  const std::vector<KdaCase> cases = {
      {1, 1, 16, 16, Decay::kStrong},    {1, 4, 128, 128, Decay::kMixed},  {63, 2, 32, 32, Decay::kMixed},
      {64, 1, 64, 64, Decay::kStrong},   {65, 3, 16, 32, Decay::kTiny},    {65, 4, 128, 64, Decay::kMixed},
      {150, 4, 32, 16, Decay::kMixed},   {150, 2, 128, 128, Decay::kStrong}, {300, 2, 128, 128, Decay::kMixed},
      {307, 4, 64, 64, Decay::kStrong},  {307, 1, 128, 128, Decay::kTiny}, {307, 3, 32, 64, Decay::kMixed},
  };
  double worst_cr = 0.0, worst_ref = 0.0;
  uint32_t seed = 1;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "T=" << c.n_tokens << " H=" << c.n_heads << " K=" << c.dim_k
                                    << " V=" << c.dim_v << " decay=" << static_cast<int>(c.decay));
    const KdaInputs in = make_inputs(c, seed++);
    const KdaResult rec = run(in, Algo::kRecurrent);
    const KdaResult chk = run(in, Algo::kChunked);
    std::vector<double> ref_state, ref_out;
    reference_f64(in, ref_state, ref_out);
    const double cr = std::max(rel_err(chk.out, rec.out), rel_err(chk.state, rec.state));
    const double ref = std::max({rel_err(chk.out, ref_out), rel_err(chk.state, ref_state),
                                 rel_err(rec.out, ref_out), rel_err(rec.state, ref_state)});
    EXPECT_LE(cr, 2e-5);
    EXPECT_LE(ref, 2e-5);
    worst_cr = std::max(worst_cr, cr);
    worst_ref = std::max(worst_ref, ref);
  }
  std::printf("[kda] max rel err: chunked vs recurrent %.3g, fp32 vs float64 reference %.3g\n", worst_cr, worst_ref);
}

TEST(Kda, SplitCallsMatchOneCall) {
  const KdaInputs in = make_inputs({157, 3, 64, 32, Decay::kMixed}, 77);
  const KdaResult whole = run(in, Algo::kRecurrent);
  // Chunked prefill of 100 then 57 tokens.
  KdaResult split{std::vector<float>(whole.out.size(), NAN), in.state};
  run_range(in, Algo::kChunked, 0, 100, split);
  run_range(in, Algo::kChunked, 100, 157, split);
  EXPECT_LE(rel_err(split.out, whole.out), 1e-5);
  EXPECT_LE(rel_err(split.state, whole.state), 1e-5);
  // Chunked prefill then token-by-token recurrent decode, with an odd chunk size.
  KdaResult mixed{std::vector<float>(whole.out.size(), NAN), in.state};
  run_range(in, Algo::kChunked, 0, 130, mixed, 48);
  for (int64_t t = 130; t < 157; ++t) run_range(in, Algo::kRecurrent, t, t + 1, mixed);
  EXPECT_LE(rel_err(mixed.out, whole.out), 1e-5);
  EXPECT_LE(rel_err(mixed.state, whole.state), 1e-5);
  // Ragged chunked calls, including a one-token and an empty call.
  KdaResult ragged{std::vector<float>(whole.out.size(), NAN), in.state};
  const int64_t cuts[] = {0, 1, 64, 64, 93, 157};
  for (size_t i = 0; i + 1 < std::size(cuts); ++i) run_range(in, Algo::kChunked, cuts[i], cuts[i + 1], ragged);
  EXPECT_LE(rel_err(ragged.out, whole.out), 1e-5);
  EXPECT_LE(rel_err(ragged.state, whole.state), 1e-5);
}

TEST(Kda, AnyChunkSizeAgrees) {
  const KdaInputs in = make_inputs({150, 2, 32, 32, Decay::kStrong}, 5);
  const KdaResult rec = run(in, Algo::kRecurrent);
  for (int64_t chunk : {1, 7, 16, 64, 100, 150, 1024}) {
    SCOPED_TRACE(testing::Message() << "chunk=" << chunk);
    const KdaResult chk = run(in, Algo::kChunked, chunk);
    EXPECT_LE(rel_err(chk.out, rec.out), 1e-5);
    EXPECT_LE(rel_err(chk.state, rec.state), 1e-5);
  }
}

TEST(Kda, ExtremeDecaysStayFinite) {
  // Channels alternate between g = -50 (cumsum -3200 over a chunk), g = -5 and g = 0 (no decay at all).
  KdaInputs in = make_inputs({200, 2, 32, 32, Decay::kMixed}, 9);
  for (size_t i = 0; i < in.g.size(); ++i) in.g[i] = (i % 3 == 0) ? -50.0f : (i % 3 == 1 ? -5.0f : 0.0f);
  const KdaResult rec = run(in, Algo::kRecurrent);
  const KdaResult chk = run(in, Algo::kChunked);
  std::vector<double> ref_state, ref_out;
  reference_f64(in, ref_state, ref_out);
  EXPECT_LE(rel_err(chk.out, ref_out), 2e-5);  // rel_err returns inf on any non-finite value
  EXPECT_LE(rel_err(chk.state, ref_state), 2e-5);
  EXPECT_LE(rel_err(rec.out, ref_out), 2e-5);
}

TEST(Kda, HandComputedScalarHead) {
  // K = V = 1: S <- a S; u = v - S k; S += beta k u; o = S q.
  KdaInputs in;
  in.p = {2, 1, 1, 1};
  in.q = {0.5f, -2.0f};
  in.k = {1.0f, 0.75f};
  in.v = {3.0f, -1.0f};
  in.g = {-1.0f, -0.5f};
  in.beta = {0.5f, 0.25f};
  in.state = {2.0f};
  double s = 2.0;
  double expect_out[2];
  for (int t = 0; t < 2; ++t) {
    s *= std::exp(static_cast<double>(in.g[t]));
    const double u = in.v[t] - s * in.k[t];
    s += in.beta[t] * in.k[t] * u;
    expect_out[t] = s * in.q[t];
  }
  for (Algo algo : {Algo::kRecurrent, Algo::kChunked}) {
    const KdaResult r = run(in, algo);
    EXPECT_NEAR(r.out[0], expect_out[0], 1e-6);
    EXPECT_NEAR(r.out[1], expect_out[1], 1e-6);
    EXPECT_NEAR(r.state[0], s, 1e-6);
  }
}

TEST(Kda, ZeroTokensLeavesStateAlone) {
  std::vector<float> state = {1.0f, 2.0f, 3.0f, 4.0f};
  const KdaParams p{0, 1, 2, 2};
  kda_recurrent_cpu(p, nullptr, nullptr, nullptr, nullptr, nullptr, state.data(), nullptr);
  kda_chunked_cpu(p, nullptr, nullptr, nullptr, nullptr, nullptr, state.data(), nullptr);
  EXPECT_EQ(state, (std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f}));
}

TEST(Kda, RejectsBadParams) {
  std::vector<float> buf(64, 0.0f), state(64, 0.0f), out(64, 0.0f);
  const float* x = buf.data();
  EXPECT_THROW(kda_recurrent_cpu({-1, 1, 4, 4}, x, x, x, x, x, state.data(), out.data()), Error);
  EXPECT_THROW(kda_recurrent_cpu({1, 0, 4, 4}, x, x, x, x, x, state.data(), out.data()), Error);
  EXPECT_THROW(kda_chunked_cpu({1, 1, 0, 4}, x, x, x, x, x, state.data(), out.data()), Error);
  EXPECT_THROW(kda_chunked_cpu({1, 1, 4, 4}, x, x, x, x, x, state.data(), out.data(), 0), Error);
  EXPECT_THROW(kda_chunked_cpu({1, 1, 4, 4}, x, x, x, x, x, nullptr, out.data()), Error);
  EXPECT_THROW(kda_chunked_cpu({1, 1, 4, 4}, x, nullptr, x, x, x, state.data(), out.data()), Error);
  EXPECT_THROW(kda_recurrent_cpu({1, 1, 4, 4}, x, x, x, x, x, state.data(), state.data()), Error);
}

}  // namespace
}  // namespace bg::ops
