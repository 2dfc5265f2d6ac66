// CPU reference for KDA (fp32): the recurrent gated delta rule and the chunked WY/UT form, parallel over heads.
//
// Chunked form, for one head and one chunk of n tokens starting from state S0 [K, V]. With G_i the cumulative log
// decay inside the chunk (G_i = g_0 + ... + g_i, a [K] vector) and u_i the "new value" beta_i (v_i - S_{i-1}'^T k_i)
// that the recurrence adds as k_i u_i^T (S_{i-1}' the decayed previous state), the recurrence unrolls to
//   S_i = exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) k_j u_j^T                  (exp(.) scales the key axis)
// so the new values solve a unit lower-triangular system (the UT transform):
//   u_i + sum_{j<i} A_ij u_j = beta_i (v_i - S0^T (exp(G_i) k_i)),  A_ij = beta_i sum_d k_i[d] k_j[d] exp(G_i-G_j)[d]
// which forward substitution solves row by row (equal to fla's WY form u - w S0 with (I + A)^-1 applied to both).
// Then o_i = S0^T (exp(G_i) q_i) + sum_{j<=i} (q_i . exp(G_i - G_j) k_j) u_j, and the chunk leaves
//   S = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T.
// Every exponent is G_i - G_j with i >= j (or G_i itself), a sum of log decays, so it is <= 0 and nothing overflows.
#include "ops/kda/kda.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace bg::ops {
namespace {

// The raw pointers of one call, as passed in.
struct KdaTensors {
  const float* q;
  const float* k;
  const float* v;
  const float* g;
  const float* beta;
  float* out;
};

// One head's slice of the token-major tensors: token t of the head sits at base + t * stride.
struct HeadInputs {
  const float* q;     // q, k, g of token t: + t * qk_stride, [K]
  const float* k;
  const float* g;
  const float* v;     // v, out of token t: + t * v_stride, [V]
  const float* beta;  // + t * beta_stride, a scalar
  float* out;
  int64_t qk_stride;
  int64_t v_stride;
  int64_t beta_stride;
  int64_t dim_k;
  int64_t dim_v;
};

HeadInputs head_inputs(const KdaParams& p, const KdaTensors& x, int64_t h) {
  const int64_t dk = p.head_dim_k;
  const int64_t dv = p.head_dim_v;
  return HeadInputs{x.q + h * dk,  x.k + h * dk,   x.g + h * dk,    x.v + h * dv, x.beta + h, x.out + h * dv,
                    p.n_heads * dk, p.n_heads * dv, p.n_heads, dk, dv};
}

void check_kda_args(const char* op, const KdaParams& p, const KdaTensors& x, const float* state) {
  BG_CHECK(p.n_tokens >= 0, "{}: n_tokens {} is negative", op, p.n_tokens);
  BG_CHECK(p.n_heads > 0, "{}: n_heads {} must be positive", op, p.n_heads);
  BG_CHECK(p.head_dim_k > 0 && p.head_dim_v > 0, "{}: head dims k={} v={} must be positive", op, p.head_dim_k,
           p.head_dim_v);
  BG_CHECK(state != nullptr, "{}: state is null", op);
  if (p.n_tokens == 0) return;
  BG_CHECK(x.q && x.k && x.v && x.g && x.beta && x.out, "{}: null input/output pointer with n_tokens {}", op,
           p.n_tokens);
  BG_CHECK(x.out != state && x.out != x.q && x.out != x.k && x.out != x.v, "{}: out aliases an input or the state",
           op);
}

// ---- recurrent form ----

// Runs n_tokens steps of one head. s [K, V] in/out; u is scratch [V].
void recurrent_head(const HeadInputs& x, int64_t n_tokens, float* s, std::vector<float>& u) {
  const int64_t dk = x.dim_k;
  const int64_t dv = x.dim_v;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* qt = x.q + t * x.qk_stride;
    const float* kt = x.k + t * x.qk_stride;
    const float* gt = x.g + t * x.qk_stride;
    const float* vt = x.v + t * x.v_stride;
    float* ot = x.out + t * x.v_stride;
    const float bt = x.beta[t * x.beta_stride];
    // Pass 1: S <- diag(exp(g)) S, and u = v - S^T k on the decayed S.
    std::copy(vt, vt + dv, u.begin());
    for (int64_t d = 0; d < dk; ++d) {
      const float a = std::exp(gt[d]);
      const float kd = kt[d];
      float* row = s + d * dv;
      for (int64_t j = 0; j < dv; ++j) {
        row[j] *= a;
        u[j] -= kd * row[j];
      }
    }
    // Pass 2: S += beta k u^T, and o = S^T q on the updated S.
    std::fill(ot, ot + dv, 0.0f);
    for (int64_t d = 0; d < dk; ++d) {
      const float bk = bt * kt[d];
      const float qd = qt[d];
      float* row = s + d * dv;
      for (int64_t j = 0; j < dv; ++j) {
        row[j] += bk * u[j];
        ot[j] += qd * row[j];
      }
    }
  }
}

// ---- chunked form ----

// Per-thread buffers for one chunk (rows are strided by the full chunk size C; only n <= C rows are used).
struct ChunkScratch {
  ChunkScratch(int64_t chunk, int64_t dk, int64_t dv)
      : c(chunk), cum_g(chunk * dk), a_kk(chunk * chunk), a_qk(chunk * chunk), u(chunk * dv), decayed(dk) {}
  int64_t c;
  std::vector<float> cum_g;    // [C, K] G_i, cumulative log decay up to and including token i of the chunk
  std::vector<float> a_kk;     // [C, C] strictly lower: beta_i k_i . (exp(G_i - G_j) k_j)
  std::vector<float> a_qk;     // [C, C] lower incl. diagonal: q_i . (exp(G_i - G_j) k_j)
  std::vector<float> u;        // [C, V] new values after the UT transform
  std::vector<float> decayed;  // [K] exp(G_i) * (k_i or q_i)
};

// G_i = sum_{s<=i} g_s over the chunk's tokens t0 .. t0+n-1.
void chunk_cumulative_decay(const HeadInputs& x, int64_t t0, int64_t n, ChunkScratch& sc) {
  const int64_t dk = x.dim_k;
  for (int64_t i = 0; i < n; ++i) {
    const float* gi = x.g + (t0 + i) * x.qk_stride;
    float* cum = sc.cum_g.data() + i * dk;
    if (i == 0) {
      std::copy(gi, gi + dk, cum);
      continue;
    }
    const float* prev = cum - dk;
    for (int64_t d = 0; d < dk; ++d) cum[d] = prev[d] + gi[d];
  }
}

// The intra-chunk key-key and query-key interactions, with decay exp(G_i - G_j) (i >= j, exponent <= 0).
void chunk_interactions(const HeadInputs& x, int64_t t0, int64_t n, ChunkScratch& sc) {
  const int64_t dk = x.dim_k;
  for (int64_t i = 0; i < n; ++i) {
    const float* qi = x.q + (t0 + i) * x.qk_stride;
    const float* ki = x.k + (t0 + i) * x.qk_stride;
    const float* cum_i = sc.cum_g.data() + i * dk;
    const float bi = x.beta[(t0 + i) * x.beta_stride];
    for (int64_t j = 0; j <= i; ++j) {
      const float* kj = x.k + (t0 + j) * x.qk_stride;
      const float* cum_j = sc.cum_g.data() + j * dk;
      float kk = 0.0f;
      float qk = 0.0f;
      for (int64_t d = 0; d < dk; ++d) {
        const float kj_decayed = std::exp(cum_i[d] - cum_j[d]) * kj[d];
        kk += ki[d] * kj_decayed;
        qk += qi[d] * kj_decayed;
      }
      sc.a_qk[i * sc.c + j] = qk;
      if (j < i) sc.a_kk[i * sc.c + j] = bi * kk;
    }
  }
}

// u_i = beta_i (v_i - S0^T (exp(G_i) k_i)) - sum_{j<i} A_ij u_j: the UT transform by forward substitution.
void chunk_new_values(const HeadInputs& x, int64_t t0, int64_t n, const float* s, ChunkScratch& sc) {
  const int64_t dk = x.dim_k;
  const int64_t dv = x.dim_v;
  for (int64_t i = 0; i < n; ++i) {
    const float* ki = x.k + (t0 + i) * x.qk_stride;
    const float* vi = x.v + (t0 + i) * x.v_stride;
    const float* cum_i = sc.cum_g.data() + i * dk;
    const float bi = x.beta[(t0 + i) * x.beta_stride];
    float* ui = sc.u.data() + i * dv;
    std::copy(vi, vi + dv, ui);
    for (int64_t d = 0; d < dk; ++d) {
      const float kd = std::exp(cum_i[d]) * ki[d];
      const float* row = s + d * dv;
      for (int64_t j = 0; j < dv; ++j) ui[j] -= kd * row[j];
    }
    for (int64_t j = 0; j < dv; ++j) ui[j] *= bi;
    for (int64_t m = 0; m < i; ++m) {
      const float a = sc.a_kk[i * sc.c + m];
      const float* um = sc.u.data() + m * dv;
      for (int64_t j = 0; j < dv; ++j) ui[j] -= a * um[j];
    }
  }
}

// o_i = S0^T (exp(G_i) q_i) + sum_{j<=i} a_qk[i][j] u_j, written to the output tokens of the chunk.
void chunk_output(const HeadInputs& x, int64_t t0, int64_t n, const float* s, ChunkScratch& sc) {
  const int64_t dk = x.dim_k;
  const int64_t dv = x.dim_v;
  for (int64_t i = 0; i < n; ++i) {
    const float* qi = x.q + (t0 + i) * x.qk_stride;
    const float* cum_i = sc.cum_g.data() + i * dk;
    float* oi = x.out + (t0 + i) * x.v_stride;
    std::fill(oi, oi + dv, 0.0f);
    for (int64_t d = 0; d < dk; ++d) {
      const float qd = std::exp(cum_i[d]) * qi[d];
      const float* row = s + d * dv;
      for (int64_t j = 0; j < dv; ++j) oi[j] += qd * row[j];
    }
    for (int64_t m = 0; m <= i; ++m) {
      const float a = sc.a_qk[i * sc.c + m];
      const float* um = sc.u.data() + m * dv;
      for (int64_t j = 0; j < dv; ++j) oi[j] += a * um[j];
    }
  }
}

// S <- exp(G_last) S + sum_j exp(G_last - G_j) k_j u_j^T.
void chunk_state_update(const HeadInputs& x, int64_t t0, int64_t n, float* s, ChunkScratch& sc) {
  const int64_t dk = x.dim_k;
  const int64_t dv = x.dim_v;
  const float* cum_last = sc.cum_g.data() + (n - 1) * dk;
  for (int64_t d = 0; d < dk; ++d) {
    float* row = s + d * dv;
    const float a = std::exp(cum_last[d]);
    for (int64_t j = 0; j < dv; ++j) row[j] *= a;
    for (int64_t m = 0; m < n; ++m) {
      const float* km = x.k + (t0 + m) * x.qk_stride;
      const float c = std::exp(cum_last[d] - sc.cum_g[m * dk + d]) * km[d];
      const float* um = sc.u.data() + m * dv;
      for (int64_t j = 0; j < dv; ++j) row[j] += c * um[j];
    }
  }
}

void chunked_head(const HeadInputs& x, int64_t n_tokens, float* s, ChunkScratch& sc) {
  for (int64_t t0 = 0; t0 < n_tokens; t0 += sc.c) {
    const int64_t n = std::min(sc.c, n_tokens - t0);
    chunk_cumulative_decay(x, t0, n, sc);
    chunk_interactions(x, t0, n, sc);
    chunk_new_values(x, t0, n, s, sc);  // reads S0
    chunk_output(x, t0, n, s, sc);      // reads S0
    chunk_state_update(x, t0, n, s, sc);
  }
}

}  // namespace

void kda_recurrent_cpu(const KdaParams& p, const float* q, const float* k, const float* v, const float* g,
                       const float* beta, float* state, float* out) {
  const KdaTensors x{q, k, v, g, beta, out};
  check_kda_args("kda_recurrent_cpu", p, x, state);
  if (p.n_tokens == 0) return;
  const int64_t state_stride = p.head_dim_k * p.head_dim_v;
  parallel_for(p.n_heads, 1, [&](int64_t h_begin, int64_t h_end) {
    std::vector<float> u(p.head_dim_v);
    for (int64_t h = h_begin; h < h_end; ++h) {
      recurrent_head(head_inputs(p, x, h), p.n_tokens, state + h * state_stride, u);
    }
  });
}

void kda_chunked_cpu(const KdaParams& p, const float* q, const float* k, const float* v, const float* g,
                     const float* beta, float* state, float* out, int64_t chunk_size) {
  const KdaTensors x{q, k, v, g, beta, out};
  check_kda_args("kda_chunked_cpu", p, x, state);
  BG_CHECK(chunk_size > 0 && chunk_size <= 1024, "kda_chunked_cpu: chunk_size {} outside [1, 1024]", chunk_size);
  if (p.n_tokens == 0) return;
  const int64_t chunk = std::min(chunk_size, p.n_tokens);
  const int64_t state_stride = p.head_dim_k * p.head_dim_v;
  parallel_for(p.n_heads, 1, [&](int64_t h_begin, int64_t h_end) {
    ChunkScratch sc(chunk, p.head_dim_k, p.head_dim_v);
    for (int64_t h = h_begin; h < h_end; ++h) {
      chunked_head(head_inputs(p, x, h), p.n_tokens, state + h * state_stride, sc);
    }
  });
}

}  // namespace bg::ops
