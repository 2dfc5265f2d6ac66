// KDA CUDA kernels against the CPU reference at Kimi-K3 dims (K = V = 128) with K3-like decays (at the -5 floor, near
// -5, near 0, mixed) and a nonzero initial state: chunked prefill (the tensor-core path) vs kda_chunked_cpu /
// kda_recurrent_cpu and a float64 recurrence, the recurrent step for one sequence and for a batch of sequences on
// shuffled state slots, prefills split across calls, and the varlen launch over ragged sequences on shuffled slots.
// The same again at the small head dims of the golden and random test checkpoints (4 x 32, 2 x 64, 8 x 16) and at
// K != V (the CUDA-core fallback). The fp32 state is compared at 1e-4, the bf16 outputs at 1e-2 (relative to
// max |ref|); each comparison prints its error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "cuda_testing.h"
#include "ops/kda/kda.h"
#include "ops/kda/kda_cuda.h"
#include "ops/kda/kda_varlen_plan.h"

namespace bg::ops {
namespace {

using cuda::DeviceBuffer;
using testing::from_bf16;
using testing::max_rel_error;
using testing::random_floats;
using testing::to_bf16;

constexpr int64_t kDim = 128;  // Kimi-K3 / Kimi-Linear K = V
constexpr double kTolState = 1e-4;

enum class Decay {
  kStrong,  // g = -5 sigmoid(x), x ~ N(2, 2): most channels near -5
  kTiny,    // x ~ N(-9, 1): g ~ -5e-4, almost no forgetting
  kMixed,   // x ~ N(0, 4): anything in (-5, 0)
  kFloor,   // x ~ N(9, 0.5): every channel within 1e-3 of K3's -5 lower bound (the largest intra-chunk factors)
};

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// One sequence's inputs; q, k, v hold the bf16-rounded values the GPU sees (the *_bits).
struct KdaData {
  KdaParams p;
  std::vector<float> q, k, v, g, beta, state;
  std::vector<uint16_t> q_bits, k_bits, v_bits;
  int64_t dk() const { return p.head_dim_k; }
  int64_t dv() const { return p.head_dim_v; }
};

void normalize_rows(std::vector<float>& x, int64_t dim, float scale) {
  for (size_t r = 0; r < x.size(); r += static_cast<size_t>(dim)) {
    float ss = 0.0f;
    for (int64_t d = 0; d < dim; ++d) ss += x[r + d] * x[r + d];
    const float inv = scale / std::sqrt(ss + 1e-6f);
    for (int64_t d = 0; d < dim; ++d) x[r + d] *= inv;
  }
}

KdaData make_data(int64_t n_tokens, int64_t n_heads, Decay decay, uint64_t seed, int64_t dk = kDim,
                  int64_t dv = kDim) {
  KdaData x;
  x.p = {n_tokens, n_heads, dk, dv};
  const size_t n_qk = static_cast<size_t>(n_tokens * n_heads * dk);
  x.q = random_floats(n_qk, 1.0f, seed);
  x.k = random_floats(n_qk, 1.0f, seed + 1);
  normalize_rows(x.q, dk, 1.0f / std::sqrt(static_cast<float>(dk)));
  normalize_rows(x.k, dk, 1.0f);
  x.v = random_floats(static_cast<size_t>(n_tokens * n_heads * dv), 1.0f, seed + 2);
  x.q_bits = to_bf16(x.q);
  x.k_bits = to_bf16(x.k);
  x.v_bits = to_bf16(x.v);
  const float mean = decay == Decay::kStrong ? 2.0f
                     : decay == Decay::kTiny ? -9.0f
                     : decay == Decay::kFloor ? 9.0f
                                              : 0.0f;
  const float sd = decay == Decay::kStrong ? 2.0f
                   : decay == Decay::kTiny ? 1.0f
                   : decay == Decay::kFloor ? 0.5f
                                            : 4.0f;
  x.g = random_floats(n_qk, sd, seed + 3);
  for (auto& e : x.g) e = -5.0f * sigmoid(mean + e);
  x.beta = random_floats(static_cast<size_t>(n_tokens * n_heads), 1.5f, seed + 4);
  for (auto& e : x.beta) e = sigmoid(e);
  x.state = random_floats(static_cast<size_t>(n_heads * dk * dv), 0.5f, seed + 5);
  return x;
}

// The inputs on the device; view(t) points at token t.
struct DeviceData {
  DeviceBuffer q, k, v, g, beta;
  int64_t n_heads, dk, dv;
  explicit DeviceData(const KdaData& x)
      : q(cuda::upload(x.q_bits)),
        k(cuda::upload(x.k_bits)),
        v(cuda::upload(x.v_bits)),
        g(cuda::upload(x.g)),
        beta(cuda::upload(x.beta)),
        n_heads(x.p.n_heads),
        dk(x.dk()),
        dv(x.dv()) {}
  KdaCudaInputs view(int64_t t) const {
    const int64_t off_k = t * n_heads * dk, off_v = t * n_heads * dv;
    return {q.as<__nv_bfloat16>() + off_k, k.as<__nv_bfloat16>() + off_k, v.as<__nv_bfloat16>() + off_v,
            g.as<float>() + off_k, beta.as<float>() + t * n_heads};
  }
};

struct Result {
  std::vector<float> out, state;
};

// CPU reference over tokens [t0, t1), continuing r.state.
void cpu_range(const KdaData& x, bool chunked, int64_t t0, int64_t t1, Result& r) {
  KdaParams sub = x.p;
  sub.n_tokens = t1 - t0;
  const int64_t off = t0 * x.p.n_heads * x.dk(), off_v = t0 * x.p.n_heads * x.dv();
  const float* bt = x.beta.data() + t0 * x.p.n_heads;
  if (chunked) {
    kda_chunked_cpu(sub, x.q.data() + off, x.k.data() + off, x.v.data() + off_v, x.g.data() + off, bt,
                    r.state.data(), r.out.data() + off_v);
  } else {
    kda_recurrent_cpu(sub, x.q.data() + off, x.k.data() + off, x.v.data() + off_v, x.g.data() + off, bt,
                      r.state.data(), r.out.data() + off_v);
  }
}

// The recurrence in float64 over the same (bf16-rounded) inputs: the error floor of both fp32 implementations.
Result f64_run(const KdaData& x) {
  const int64_t n_heads = x.p.n_heads, dk = x.dk(), dv = x.dv();
  Result r{std::vector<float>(x.v.size()), std::vector<float>(x.state.size())};
  std::vector<double> s(static_cast<size_t>(dk * dv)), u(static_cast<size_t>(dv));
  for (int64_t h = 0; h < n_heads; ++h) {
    for (int64_t i = 0; i < dk * dv; ++i) s[static_cast<size_t>(i)] = x.state[static_cast<size_t>(h * dk * dv + i)];
    for (int64_t t = 0; t < x.p.n_tokens; ++t) {
      const size_t kq = static_cast<size_t>((t * n_heads + h) * dk), vo = static_cast<size_t>((t * n_heads + h) * dv);
      const double beta = x.beta[static_cast<size_t>(t * n_heads + h)];
      for (int64_t j = 0; j < dv; ++j) u[static_cast<size_t>(j)] = x.v[vo + static_cast<size_t>(j)];
      for (int64_t d = 0; d < dk; ++d) {
        const double a = std::exp(static_cast<double>(x.g[kq + static_cast<size_t>(d)]));
        for (int64_t j = 0; j < dv; ++j) {
          double& e = s[static_cast<size_t>(d * dv + j)];
          e *= a;
          u[static_cast<size_t>(j)] -= x.k[kq + static_cast<size_t>(d)] * e;
        }
      }
      std::vector<double> o(static_cast<size_t>(dv), 0.0);
      for (int64_t d = 0; d < dk; ++d) {
        const double bk = beta * x.k[kq + static_cast<size_t>(d)], qd = x.q[kq + static_cast<size_t>(d)];
        for (int64_t j = 0; j < dv; ++j) {
          double& e = s[static_cast<size_t>(d * dv + j)];
          e += bk * u[static_cast<size_t>(j)];
          o[static_cast<size_t>(j)] += qd * e;
        }
      }
      for (int64_t j = 0; j < dv; ++j) {
        r.out[vo + static_cast<size_t>(j)] = static_cast<float>(o[static_cast<size_t>(j)]);
      }
    }
    for (int64_t i = 0; i < dk * dv; ++i) {
      r.state[static_cast<size_t>(h * dk * dv + i)] = static_cast<float>(s[static_cast<size_t>(i)]);
    }
  }
  return r;
}

Result cpu_run(const KdaData& x, bool chunked) {
  Result r{std::vector<float>(x.v.size(), NAN), x.state};
  cpu_range(x, chunked, 0, x.p.n_tokens, r);
  return r;
}

// The GPU side of one sequence: its state and output buffers.
struct GpuSequence {
  const KdaData& x;
  DeviceData in;
  DeviceBuffer state, out, slot, ws;
  explicit GpuSequence(const KdaData& data)
      : x(data),
        in(data),
        state(cuda::upload(data.state)),
        out(data.v.size() * 2),
        slot(cuda::upload(std::vector<int32_t>{0})),
        ws(std::max<size_t>(16, kda_chunked_workspace_bytes(data.p, kda_chunk_count(data.p.n_tokens)))) {
    out.fill_bytes(0xff);
    ws.fill_bytes(0xff);  // every workspace byte the kernels read must have been written this launch
  }
  void chunked(int64_t t0, int64_t t1) {
    KdaParams sub = x.p;
    sub.n_tokens = t1 - t0;
    kda_chunked_cuda(sub, in.view(t0), state.as<float>(), out.as<__nv_bfloat16>() + t0 * x.p.n_heads * x.dv(),
                     {ws.data(), ws.bytes()}, nullptr);
  }
  void recurrent(int64_t t0, int64_t t1) {
    KdaParams one = x.p;
    one.n_tokens = 1;
    const KdaStateSlots slots{state.as<float>(), slot.as<int32_t>(), x.p.n_heads * x.dk() * x.dv()};
    for (int64_t t = t0; t < t1; ++t) {
      kda_recurrent_cuda(one, in.view(t), slots, out.as<__nv_bfloat16>() + t * x.p.n_heads * x.dv(), nullptr);
    }
  }
  Result result() const {
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    return {from_bf16(cuda::download<uint16_t>(out, x.v.size())), cuda::download<float>(state, x.state.size())};
  }
};

void expect_close(const Result& got, const Result& ref, const char* what) {
  const double e_out = max_rel_error(got.out, ref.out), e_state = max_rel_error(got.state, ref.state);
  EXPECT_LE(e_out, testing::kTolBf16Out) << what << ": output";
  EXPECT_LE(e_state, kTolState) << what << ": state";
  std::printf("[kda] %-28s out %.3g  state %.3g\n", what, e_out, e_state);
}

struct Case {
  int64_t n_tokens, n_heads;
  Decay decay;
};

TEST(KdaCuda, ChunkedPrefillMatchesCpu) {
  BG_REQUIRE_GPU();
  const Case cases[] = {{1, 96, Decay::kStrong},    {63, 96, Decay::kMixed},   {64, 96, Decay::kTiny},
                        {65, 96, Decay::kStrong},   {300, 96, Decay::kMixed},  {300, 16, Decay::kTiny},
                        {1000, 16, Decay::kStrong}, {1000, 16, Decay::kMixed}, {1000, 16, Decay::kTiny},
                        {5, 96, Decay::kMixed},     {15, 3, Decay::kFloor},    {17, 2, Decay::kStrong},
                        {200, 8, Decay::kFloor},    {1, 1, Decay::kTiny},      {129, 1, Decay::kFloor}};
  uint64_t seed = 100;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.n_tokens << " H=" << c.n_heads << " decay "
                                      << static_cast<int>(c.decay));
    const KdaData x = make_data(c.n_tokens, c.n_heads, c.decay, seed += 10);
    GpuSequence gpu(x);
    gpu.chunked(0, c.n_tokens);
    const Result got = gpu.result();
    expect_close(got, cpu_run(x, true), "chunked vs cpu chunked");
    expect_close(got, cpu_run(x, false), "chunked vs cpu recurrent");
    if (c.n_tokens * c.n_heads <= 20000) expect_close(got, f64_run(x), "chunked vs float64 recurrent");
  }
}

TEST(KdaCuda, RecurrentStepsMatchCpu) {
  BG_REQUIRE_GPU();
  const Case cases[] = {{1, 96, Decay::kMixed},  {63, 96, Decay::kStrong},  {64, 96, Decay::kTiny},
                        {65, 96, Decay::kMixed}, {300, 32, Decay::kStrong}, {1000, 8, Decay::kTiny}};
  uint64_t seed = 200;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.n_tokens << " H=" << c.n_heads << " decay "
                                      << static_cast<int>(c.decay));
    const KdaData x = make_data(c.n_tokens, c.n_heads, c.decay, seed += 10);
    GpuSequence gpu(x);
    gpu.recurrent(0, c.n_tokens);
    expect_close(gpu.result(), cpu_run(x, false), "recurrent vs cpu recurrent");
  }
}

void check_split_calls(int64_t n_heads, int64_t dk, int64_t dv, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "H=" << n_heads << " K=" << dk << " V=" << dv);
  const KdaData x = make_data(260, n_heads, Decay::kMixed, seed, dk, dv);
  const Result whole = cpu_run(x, false);
  {
    // Ragged chunked calls (cuts inside and on chunk edges, a one-token and an empty call), then decode steps.
    GpuSequence gpu(x);
    const int64_t cuts[] = {0, 1, 64, 64, 100, 165, 229, 250};
    for (size_t i = 0; i + 1 < std::size(cuts); ++i) gpu.chunked(cuts[i], cuts[i + 1]);
    gpu.recurrent(250, 260);
    expect_close(gpu.result(), whole, "split chunked + recurrent");
  }
  {
    // Decode steps first, then a chunked prefill continues the state.
    GpuSequence gpu(x);
    gpu.recurrent(0, 3);
    gpu.chunked(3, 260);
    expect_close(gpu.result(), whole, "recurrent + chunked");
  }
}

TEST(KdaCuda, SplitCallsMatchOneCpuCall) {
  BG_REQUIRE_GPU();
  check_split_calls(32, kDim, kDim, 300);
}

// Decode batches of 9 sequences on 13 shuffled, padded state slots, 5 steps; `splits` as kda_recurrent_cuda takes it.
// Returns the pool and the outputs.
std::pair<std::vector<float>, std::vector<float>> check_recurrent_batch(int64_t n_heads, int64_t dk, int64_t dv,
                                                                        uint64_t seed, int splits = 0) {
  SCOPED_TRACE(::testing::Message() << "H=" << n_heads << " K=" << dk << " V=" << dv);
  constexpr int64_t kSeqs = 9, kSlots = 13, kSteps = 5;
  const int64_t state_floats = n_heads * dk * dv, stride = state_floats + 256;  // padded slots
  std::vector<int32_t> slot_of(kSlots);
  std::iota(slot_of.begin(), slot_of.end(), 0);
  std::shuffle(slot_of.begin(), slot_of.end(), std::mt19937_64(7));
  slot_of.resize(kSeqs);  // sequence s lives in slot slot_of[s]; 4 slots stay unused
  std::vector<KdaData> seqs;
  for (int64_t s = 0; s < kSeqs; ++s)
    seqs.push_back(make_data(kSteps, n_heads, static_cast<Decay>(s % 3), seed + 10 * s, dk, dv));

  std::vector<float> pool = random_floats(static_cast<size_t>(kSlots * stride), 0.5f, seed + 1);
  for (int64_t s = 0; s < kSeqs; ++s)
    std::copy(seqs[s].state.begin(), seqs[s].state.end(), pool.begin() + slot_of[s] * stride);
  DeviceBuffer d_pool = cuda::upload(pool), d_slots = cuda::upload(slot_of);
  DeviceBuffer d_out(static_cast<size_t>(kSteps * kSeqs * n_heads * dv) * 2);
  d_out.fill_bytes(0xff);

  // Step t's batch: token t of every sequence, gathered [kSeqs, H, ...].
  std::vector<DeviceBuffer> keep;
  for (int64_t t = 0; t < kSteps; ++t) {
    std::vector<uint16_t> q, k, v;
    std::vector<float> g, beta;
    for (const KdaData& x : seqs) {
      const size_t off = static_cast<size_t>(t * n_heads * dk), n = static_cast<size_t>(n_heads * dk);
      const size_t off_v = static_cast<size_t>(t * n_heads * dv), n_v = static_cast<size_t>(n_heads * dv);
      q.insert(q.end(), x.q_bits.begin() + off, x.q_bits.begin() + off + n);
      k.insert(k.end(), x.k_bits.begin() + off, x.k_bits.begin() + off + n);
      v.insert(v.end(), x.v_bits.begin() + off_v, x.v_bits.begin() + off_v + n_v);
      g.insert(g.end(), x.g.begin() + off, x.g.begin() + off + n);
      beta.insert(beta.end(), x.beta.begin() + t * n_heads, x.beta.begin() + (t + 1) * n_heads);
    }
    for (auto* b : {&q, &k, &v}) keep.push_back(cuda::upload(*b));
    keep.push_back(cuda::upload(g));
    keep.push_back(cuda::upload(beta));
    const size_t n_buf = keep.size();
    const KdaCudaInputs in{keep[n_buf - 5].as<__nv_bfloat16>(), keep[n_buf - 4].as<__nv_bfloat16>(),
                           keep[n_buf - 3].as<__nv_bfloat16>(), keep[n_buf - 2].as<float>(),
                           keep[n_buf - 1].as<float>()};
    const KdaParams p{kSeqs, n_heads, dk, dv};
    kda_recurrent_cuda(p, in, {d_pool.as<float>(), d_slots.as<int32_t>(), stride},
                       d_out.as<__nv_bfloat16>() + t * kSeqs * n_heads * dv, nullptr, splits);
  }
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got_pool = cuda::download<float>(d_pool, pool.size());
  const std::vector<float> got_out =
      from_bf16(cuda::download<uint16_t>(d_out, static_cast<size_t>(kSteps * kSeqs * n_heads * dv)));

  for (int64_t s = 0; s < kSeqs; ++s) {
    SCOPED_TRACE(::testing::Message() << "sequence " << s << " slot " << slot_of[s]);
    const Result ref = cpu_run(seqs[s], false);
    Result got;
    got.state.assign(got_pool.begin() + slot_of[s] * stride, got_pool.begin() + slot_of[s] * stride + state_floats);
    for (int64_t t = 0; t < kSteps; ++t) {
      const auto row = got_out.begin() + (t * kSeqs + s) * n_heads * dv;
      got.out.insert(got.out.end(), row, row + n_heads * dv);
    }
    expect_close(got, ref, "batched recurrent");
  }
  // Unused slots and the padding between slots are untouched.
  size_t n_changed = 0;
  for (size_t i = 0; i < pool.size(); ++i) {
    const int64_t slot = static_cast<int64_t>(i) / stride, in_slot = static_cast<int64_t>(i) % stride;
    const bool used = std::find(slot_of.begin(), slot_of.end(), slot) != slot_of.end() && in_slot < state_floats;
    if (!used) n_changed += got_pool[i] != pool[i];
  }
  EXPECT_EQ(n_changed, 0u);
  return {got_pool, got_out};
}

// A head's columns split over 4 CTAs run the same arithmetic per column as one CTA: the same bits.
// The recurrent step is bound by the state's bytes; with one 512-thread CTA per SM (76 registers, once) it ran 37 %
// slower on the H200 than with two. 1024 threads per SM either way.
TEST(KdaCuda, RecurrentKernelKeepsTwoCtasPerSm) {
  BG_REQUIRE_GPU();
  EXPECT_GE(kda_recurrent_ctas_per_sm(1), 2);
  EXPECT_GE(kda_recurrent_ctas_per_sm(4), 8);
}

TEST(KdaCuda, RecurrentColumnSplitIsBitIdentical) {
  BG_REQUIRE_GPU();
  const auto whole = check_recurrent_batch(96, kDim, kDim, 410, 1);
  const auto split = check_recurrent_batch(96, kDim, kDim, 410, 4);
  EXPECT_TRUE(whole.first == split.first) << "state differs";
  EXPECT_TRUE(whole.second == split.second) << "outputs differ";
  EXPECT_THROW(check_recurrent_batch(96, kDim, kDim, 410, 2), Error);
  EXPECT_EQ(kda_recurrent_splits(96, nullptr), 4);  // unset: auto
  EXPECT_EQ(kda_recurrent_splits(16 * 96, nullptr), 1);
  EXPECT_EQ(kda_recurrent_splits(96, "auto"), 4);  // one token of 96 heads
  EXPECT_EQ(kda_recurrent_splits(16 * 96, "auto"), 1);
  EXPECT_EQ(kda_recurrent_splits(96, "1"), 1);
  EXPECT_EQ(kda_recurrent_splits(16 * 96, "4"), 4);
  for (const char* bad : {"2", "0", "x"}) EXPECT_THROW(kda_recurrent_splits(96, bad), Error) << bad;
}

// A decode graph's padding rows (KdaStateSlots::live_tokens): rows 5..7 share the padding slot, poisoned with NaN, and
// must leave it untouched and write zero outputs; rows 0..4 give the bits of a launch of those five rows alone.
TEST(KdaCuda, RecurrentPaddingRowsAreSkipped) {
  BG_REQUIRE_GPU();
  constexpr int64_t kH = 96, kRows = 8, kLive = 5;
  const int64_t sf = kH * kDim * kDim;
  const KdaData x = make_data(kRows, kH, Decay::kMixed, 430);  // row r = token r of a batch of one-token sequences
  const DeviceData d(x);
  std::vector<float> pool = random_floats(static_cast<size_t>((kLive + 1) * sf), 0.5f, 431);
  std::fill(pool.begin() + kLive * sf, pool.end(), std::nanf(""));
  const std::vector<int32_t> slots{0, 1, 2, 3, 4, 5, 5, 5};
  const size_t n_out = static_cast<size_t>(kRows * kH * kDim);
  for (const int splits : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "splits " << splits);
    DeviceBuffer pool_a = cuda::upload(pool), pool_b = cuda::upload(pool), d_slots = cuda::upload(slots);
    DeviceBuffer live = cuda::upload(std::vector<int32_t>{kLive});
    DeviceBuffer out_a(n_out * 2), out_b(n_out * 2);
    out_a.fill_bytes(0xff);
    out_b.fill_bytes(0xff);
    kda_recurrent_cuda({kRows, kH, kDim, kDim}, d.view(0), {pool_a.as<float>(), d_slots.as<int32_t>(), sf,
                       live.as<int32_t>()}, out_a.as<__nv_bfloat16>(), nullptr, splits);
    kda_recurrent_cuda({kLive, kH, kDim, kDim}, d.view(0), {pool_b.as<float>(), d_slots.as<int32_t>(), sf},
                       out_b.as<__nv_bfloat16>(), nullptr, splits);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    const auto a = cuda::download<uint16_t>(out_a, n_out), b = cuda::download<uint16_t>(out_b, n_out);
    const size_t live_out = static_cast<size_t>(kLive * kH * kDim);
    EXPECT_TRUE(std::equal(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(live_out), b.begin()));
    EXPECT_TRUE(std::all_of(a.begin() + static_cast<std::ptrdiff_t>(live_out), a.end(), [](uint16_t v) {
      return v == 0;
    })) << "padding rows' outputs are not zero";
    const auto pa = cuda::download<float>(pool_a, pool.size()), pb = cuda::download<float>(pool_b, pool.size());
    EXPECT_EQ(std::memcmp(pa.data(), pb.data(), pool.size() * sizeof(float)), 0) << "the pools differ";
    EXPECT_EQ(std::memcmp(pa.data() + kLive * sf, pool.data() + kLive * sf, static_cast<size_t>(sf) * sizeof(float)),
              0) << "the padding slot was written";
  }
}

TEST(KdaCuda, RecurrentBatchOnShuffledSlotsMatchesCpu) {
  BG_REQUIRE_GPU();
  check_recurrent_batch(96, kDim, kDim, 400);
}

// Small head dims: those of the golden (4 x 32, 2 x 64) and random (8 x 16, 2 x 64) test checkpoints, K != V both
// ways, and odd / one-channel heads.
struct SmallShape {
  int64_t n_heads, dk, dv;
};
constexpr SmallShape kSmallShapes[] = {{4, 32, 32}, {2, 64, 64}, {8, 16, 16}, {3, 32, 64},
                                       {2, 128, 48}, {5, 7, 13}, {1, 1, 1},  {2, 100, 128}};
constexpr int64_t kSmallTokens[] = {1, 63, 64, 65, 150};

TEST(KdaCuda, SmallHeadDimsChunkedPrefillMatchesCpu) {
  BG_REQUIRE_GPU();
  uint64_t seed = 1000;
  for (const SmallShape& sh : kSmallShapes) {
    for (const int64_t n_tokens : kSmallTokens) {
      const Decay decay = static_cast<Decay>(seed % 3);
      SCOPED_TRACE(::testing::Message() << "T=" << n_tokens << " H=" << sh.n_heads << " K=" << sh.dk << " V=" << sh.dv
                                        << " decay " << static_cast<int>(decay));
      const KdaData x = make_data(n_tokens, sh.n_heads, decay, seed += 10, sh.dk, sh.dv);
      GpuSequence gpu(x);
      gpu.chunked(0, n_tokens);
      const Result got = gpu.result();
      expect_close(got, cpu_run(x, true), "small chunked vs cpu chunked");
      expect_close(got, cpu_run(x, false), "small chunked vs cpu recur");
    }
  }
}

TEST(KdaCuda, SmallHeadDimsRecurrentStepsMatchCpu) {
  BG_REQUIRE_GPU();
  uint64_t seed = 2000;
  for (const SmallShape& sh : kSmallShapes) {
    for (const int64_t n_tokens : kSmallTokens) {
      const Decay decay = static_cast<Decay>(seed % 3);
      SCOPED_TRACE(::testing::Message() << "T=" << n_tokens << " H=" << sh.n_heads << " K=" << sh.dk << " V=" << sh.dv
                                        << " decay " << static_cast<int>(decay));
      const KdaData x = make_data(n_tokens, sh.n_heads, decay, seed += 10, sh.dk, sh.dv);
      GpuSequence gpu(x);
      gpu.recurrent(0, n_tokens);
      expect_close(gpu.result(), cpu_run(x, false), "small recurrent vs cpu recur");
    }
  }
}

TEST(KdaCuda, SmallHeadDimsSplitCallsAndBatchesMatchCpu) {
  BG_REQUIRE_GPU();
  check_split_calls(4, 32, 32, 3000);
  check_split_calls(2, 64, 64, 3010);
  check_split_calls(3, 32, 64, 3020);
  check_recurrent_batch(4, 32, 32, 3100);
  check_recurrent_batch(8, 16, 16, 3200);
  check_recurrent_batch(3, 64, 24, 3300);
}

TEST(KdaCuda, RejectsUnsupportedHeadDims) {
  BG_REQUIRE_GPU();
  float dummy = 0.0f;
  for (const auto& [dk, dv] : std::vector<std::pair<int64_t, int64_t>>{{129, 128}, {128, 129}, {256, 256}, {0, 32},
                                                                         {32, 0}, {-1, 64}}) {
    const KdaParams p{4, 2, dk, dv};
    EXPECT_THROW(kda_chunked_cuda(p, {}, &dummy, nullptr, {}, nullptr), Error) << dk << " / " << dv;
    EXPECT_THROW(kda_recurrent_cuda(p, {}, {&dummy, nullptr, 0}, nullptr, nullptr), Error) << dk << " / " << dv;
  }
}

TEST(KdaCuda, ChunkedRejectsMissingOrShortWorkspace) {
  BG_REQUIRE_GPU();
  const KdaData x = make_data(65, 2, Decay::kMixed, 77);
  GpuSequence gpu(x);
  const size_t need = kda_chunked_workspace_bytes(x.p, 2);
  EXPECT_EQ(need, 4 * kda_chunked_workspace_bytes({1, 1, kDim, kDim}, 1));
  EXPECT_EQ(kda_chunked_workspace_bytes({65, 2, 64, 64}, 2), 0u);  // the CUDA-core path needs none
  auto* out = gpu.out.as<__nv_bfloat16>();
  EXPECT_THROW(kda_chunked_cuda(x.p, gpu.in.view(0), gpu.state.as<float>(), out, {gpu.ws.data(), need - 1}, nullptr),
               Error);
  EXPECT_THROW(kda_chunked_cuda(x.p, gpu.in.view(0), gpu.state.as<float>(), out, {nullptr, need}, nullptr), Error);
  EXPECT_THROW(kda_chunked_cuda(x.p, gpu.in.view(0), gpu.state.as<float>(), out + 1, {gpu.ws.data(), need}, nullptr),
               Error);  // out must be 4-byte aligned
}

// One step of ragged sequences (lengths below, one empty) on shuffled, padded state slots in ONE varlen launch; each
// sequence must equal its own recurrence from its own state. With min_tokens 2 the 1-token sequences stay out of the
// plan: their slots and output rows are untouched.
void check_varlen(int64_t n_heads, int64_t dk, int64_t dv, int64_t min_tokens, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "varlen H=" << n_heads << " K=" << dk << " V=" << dv << " min " << min_tokens);
  const std::vector<int64_t> lens{130, 1, 5, 64, 0, 17, 200, 1, 63, 65};
  const int64_t n_seqs = static_cast<int64_t>(lens.size()), n_slots = n_seqs + 3;
  const int64_t state_floats = n_heads * dk * dv, stride = state_floats + 64;
  std::vector<int32_t> slot_of(static_cast<size_t>(n_slots));
  std::iota(slot_of.begin(), slot_of.end(), 0);
  std::shuffle(slot_of.begin(), slot_of.end(), std::mt19937_64(seed));
  slot_of.resize(static_cast<size_t>(n_seqs));

  std::vector<KdaData> seqs;
  std::vector<int64_t> begin{0};
  std::vector<uint16_t> q, k, v;
  std::vector<float> g, beta;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t n = lens[static_cast<size_t>(s)];
    seqs.push_back(make_data(n, n_heads, static_cast<Decay>(s % 4), seed + 10 * static_cast<uint64_t>(s), dk, dv));
    const KdaData& x = seqs.back();
    q.insert(q.end(), x.q_bits.begin(), x.q_bits.end());
    k.insert(k.end(), x.k_bits.begin(), x.k_bits.end());
    v.insert(v.end(), x.v_bits.begin(), x.v_bits.end());
    g.insert(g.end(), x.g.begin(), x.g.end());
    beta.insert(beta.end(), x.beta.begin(), x.beta.end());
    begin.push_back(begin.back() + n);
  }
  const int64_t n_tokens = begin.back();
  std::vector<float> pool = random_floats(static_cast<size_t>(n_slots * stride), 0.5f, seed + 1);
  for (int64_t s = 0; s < n_seqs; ++s) {
    const KdaData& x = seqs[static_cast<size_t>(s)];
    std::copy(x.state.begin(), x.state.end(), pool.begin() + slot_of[static_cast<size_t>(s)] * stride);
  }
  const KdaVarlenPlan plan = kda_varlen_plan(begin, slot_of, min_tokens);
  std::vector<int32_t> packed = plan.packed();
  packed.push_back(0);  // never empty
  DeviceBuffer d_q = cuda::upload(q), d_k = cuda::upload(k), d_v = cuda::upload(v), d_g = cuda::upload(g),
               d_beta = cuda::upload(beta), d_pool = cuda::upload(pool), d_plan = cuda::upload(packed);
  const KdaParams p{n_tokens, n_heads, dk, dv};
  DeviceBuffer d_out(static_cast<size_t>(n_tokens * n_heads * dv) * 2);
  DeviceBuffer ws(std::max<size_t>(16, kda_chunked_workspace_bytes(p, plan.n_chunks())));
  d_out.fill_bytes(0xff);
  ws.fill_bytes(0xff);
  const KdaCudaInputs in{d_q.as<__nv_bfloat16>(), d_k.as<__nv_bfloat16>(), d_v.as<__nv_bfloat16>(), d_g.as<float>(),
                         d_beta.as<float>()};
  kda_chunked_varlen_cuda(p, in, {&plan, d_plan.as<int32_t>(), d_pool.as<float>(), stride}, d_out.as<__nv_bfloat16>(),
                          {ws.data(), ws.bytes()}, nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got_pool = cuda::download<float>(d_pool, pool.size());
  const std::vector<uint16_t> got_bits = cuda::download<uint16_t>(d_out, static_cast<size_t>(n_tokens * n_heads * dv));
  const std::vector<float> got_out = from_bf16(got_bits);

  for (int64_t s = 0; s < n_seqs; ++s) {
    const KdaData& x = seqs[static_cast<size_t>(s)];
    const int64_t slot = slot_of[static_cast<size_t>(s)], n = lens[static_cast<size_t>(s)];
    SCOPED_TRACE(::testing::Message() << "sequence " << s << " T=" << n << " slot " << slot);
    const auto row0 = static_cast<size_t>(begin[static_cast<size_t>(s)] * n_heads * dv);
    const auto n_out = static_cast<size_t>(n * n_heads * dv);
    Result got;
    got.state.assign(got_pool.begin() + slot * stride, got_pool.begin() + slot * stride + state_floats);
    got.out.assign(got_out.begin() + static_cast<std::ptrdiff_t>(row0),
                   got_out.begin() + static_cast<std::ptrdiff_t>(row0 + n_out));
    if (n >= min_tokens) {
      expect_close(got, cpu_run(x, false), "varlen vs cpu recurrent");
    } else {
      EXPECT_EQ(got.state, x.state) << "a sequence outside the plan changed its state";
      size_t n_written = 0;
      for (size_t i = row0; i < row0 + n_out; ++i) n_written += got_bits[i] != 0xffff;
      EXPECT_EQ(n_written, 0u) << "a sequence outside the plan got output";
    }
  }
  size_t n_changed = 0;  // unused slots and the padding between slots
  for (size_t i = 0; i < pool.size(); ++i) {
    const int64_t slot = static_cast<int64_t>(i) / stride, in_slot = static_cast<int64_t>(i) % stride;
    const bool used = std::find(slot_of.begin(), slot_of.end(), slot) != slot_of.end() && in_slot < state_floats;
    if (!used) n_changed += got_pool[i] != pool[i];
  }
  EXPECT_EQ(n_changed, 0u);
}

TEST(KdaCuda, VarlenChunkedMatchesCpuPerSequence) {
  BG_REQUIRE_GPU();
  check_varlen(96, kDim, kDim, 2, 5000);
  check_varlen(8, kDim, kDim, 1, 5100);
}

TEST(KdaCuda, SmallHeadDimsVarlenFallbackMatchesCpu) {
  BG_REQUIRE_GPU();
  check_varlen(4, 32, 32, 2, 5200);
  check_varlen(3, 64, 24, 1, 5300);
}

}  // namespace
}  // namespace bg::ops
