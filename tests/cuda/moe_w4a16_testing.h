// Shared by the W4A16 MXFP4 expert kernels' parity tests (moe_w4a16_parity_test.cpp: the decode kernel;
// moe_w4a16_prefill_parity_test.cpp: the prefill kernel): random MXFP4 experts uploaded in the kernels' layout,
// routings, one poisoned launch's device buffers, graph replays, and the rows-out CPU reference.
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "ops/moe/moe_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"

namespace bg::ops::w4a16_testing {

using testing::HostWeight;

struct ExpertSet {
  std::vector<HostWeight> gate, up, down;
  std::vector<MoeW4a16ExpertView> views;
  MoeW4a16DeviceLayer layer;
};

inline ExpertSet make_experts(int64_t n_experts, int64_t hidden, int64_t inter, uint64_t seed) {
  ExpertSet s;
  const auto E = static_cast<size_t>(n_experts);
  s.gate.reserve(E);
  s.up.reserve(E);
  s.down.reserve(E);
  const float s_in = 1.0f / std::sqrt(static_cast<float>(hidden)), s_mid = 2.0f / std::sqrt(static_cast<float>(inter));
  for (int64_t e = 0; e < n_experts; ++e) {
    const uint64_t base = seed * 1000 + static_cast<uint64_t>(e) * 3;
    s.gate.push_back(testing::random_weight(WeightFormat::kMxfp4, inter, hidden, s_in, base));
    s.up.push_back(testing::random_weight(WeightFormat::kMxfp4, inter, hidden, s_in, base + 1));
    s.down.push_back(testing::random_weight(WeightFormat::kMxfp4, hidden, inter, s_mid, base + 2));
  }
  for (size_t e = 0; e < E; ++e) s.views.push_back({&s.gate[e].w, &s.up[e].w, &s.down[e].w});
  s.layer = moe_w4a16_upload(s.views, hidden, inter);
  return s;
}

// How tokens pick experts. kSame: every token picks the same top_k experts (a random subset, random order per token),
// so each touched expert has exactly n_tokens rows. kRandom: top_k distinct experts of the first n_used, at random.
enum class Pattern { kSame, kRandom };

struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

inline Routing make_routing(int64_t n, int64_t k, int64_t n_experts, int64_t n_used, Pattern pat, uint64_t seed) {
  Routing r;
  std::vector<int32_t> pool(static_cast<size_t>(n_experts));
  std::iota(pool.begin(), pool.end(), 0);
  auto pick = [&](int64_t j, int64_t range, uint64_t salt) {
    const uint64_t h = testing::mix64(seed ^ testing::mix64(salt));
    const int64_t p = j + static_cast<int64_t>(h % static_cast<uint64_t>(range - j));
    std::swap(pool[static_cast<size_t>(j)], pool[static_cast<size_t>(p)]);
  };
  for (int64_t j = 0; j < k; ++j) pick(j, n_used, 999 + static_cast<uint64_t>(j));  // the common subset for kSame
  const std::vector<int32_t> common(pool.begin(), pool.begin() + k);
  for (int64_t t = 0; t < n; ++t) {
    if (pat == Pattern::kSame) {
      std::copy(common.begin(), common.end(), pool.begin());
      for (int64_t j = 0; j < k; ++j) pick(j, k, static_cast<uint64_t>(t * 64 + j));  // shuffle the order
    } else {
      for (int64_t j = 0; j < k; ++j) pick(j, n_used, static_cast<uint64_t>(t * 64 + j) + (1ull << 40));
    }
    for (int64_t j = 0; j < k; ++j) {
      r.ids.push_back(pool[static_cast<size_t>(j)]);
      r.weights.push_back(0.55f + testing::hash_uniform(seed + 7, static_cast<uint64_t>(t * k + j), 0.45f));
    }
  }
  return r;
}

struct RunSpec {
  int64_t n_tokens = 1;
  Pattern pattern = Pattern::kSame;
  int64_t n_used = 0;  // kRandom: experts in play (0: all)
  bool out_f32 = false;
  bool accumulate = false;
  int32_t fixed_splits = 0;
  int64_t live = -1;  // >= 0: the tokens from there on are padding (a decode graph's filler rows: no pairs)
};

// Everything one launch needs on the device, poisoned.
struct Launch {
  MoeCudaParams mp;
  MoeW4a16Params p;
  cuda::DeviceBuffer d_ids, d_w, d_x, d_out, ws_buf, d_live;
  std::unique_ptr<MoeDispatchBuffers> dispatch;
  MoeWorkspace dws;
  MoeW4a16Workspace ws;
  std::vector<uint16_t> x_bits;
  std::vector<float> x, out_init;
  std::vector<uint8_t> out_init_bytes;

  void reset_out() const {
    BG_CUDA_CHECK(cudaMemcpy(d_out.data(), out_init_bytes.data(), out_init_bytes.size(), cudaMemcpyHostToDevice));
  }
  std::vector<float> download_out() const {
    const size_t n = static_cast<size_t>(p.n_tokens * p.hidden);
    if (p.out_f32) return cuda::download<float>(d_out, n);
    return testing::from_bf16(cuda::download<uint16_t>(d_out, n));
  }
  std::vector<uint8_t> download_bits() const { return cuda::download<uint8_t>(d_out, out_init_bytes.size()); }
  void run(cudaStream_t stream) const {
    moe_w4a16_cuda(p, set->layer.weights, dws, {d_x.as<__nv_bfloat16>(), d_out.data()}, ws, stream);
  }
  const ExpertSet* set = nullptr;
};

// A fresh workspace for L.p (its shape, wide or narrow, follows the params), poisoned: h, y and partials must all be
// written before they are read.
inline void relayout(Launch& L, cudaStream_t stream) {
  L.ws_buf = cuda::DeviceBuffer(moe_w4a16_workspace_bytes(L.p));
  L.ws_buf.fill_bytes(0xff);
  L.ws = moe_w4a16_workspace_layout(L.p, L.ws_buf.data());
  moe_w4a16_workspace_init(L.ws, stream);
}

inline void prepare(Launch& L, const ExpertSet& set, int64_t hidden, int64_t inter, int64_t top_k, MoeW4a16Act act,
                    const RunSpec& spec, const Routing& r, uint64_t seed, cudaStream_t stream) {
  const int64_t n = spec.n_tokens, E = static_cast<int64_t>(set.views.size());
  L.set = &set;
  L.mp.shape = {n, top_k, E, E, true};
  L.mp.hidden = hidden;
  L.mp.inter = inter;
  L.mp.expert_format = WeightFormat::kMxfp4;
  L.mp.act = {act == MoeW4a16Act::kSiTU ? MoeGlu::kSitu : MoeGlu::kSwiGlu, 4.0f, 25.0f};
  L.mp.out_type = spec.out_f32 ? MoeOutType::kF32 : MoeOutType::kBf16;
  L.mp.accumulate = spec.accumulate;
  L.p = moe_w4a16_params(L.mp, spec.fixed_splits);
  L.x_bits = testing::random_bf16(static_cast<size_t>(n * hidden), 1.0f, seed, &L.x);
  L.d_x = cuda::upload(L.x_bits);
  L.d_ids = cuda::upload(r.ids);
  L.d_w = cuda::upload(r.weights);
  L.dispatch = std::make_unique<MoeDispatchBuffers>(L.mp);
  L.dws = L.dispatch->ws;
  if (spec.live >= 0) {
    L.d_live = cuda::upload(std::vector<int32_t>{static_cast<int32_t>(spec.live)});
    L.dws.live_tokens = L.d_live.as<int32_t>();
  }
  moe_dispatch_cuda(L.mp, L.d_ids.as<int32_t>(), L.d_w.as<float>(), L.dws, stream);
  relayout(L, stream);
  // Output: poisoned (0xff = NaN), or random values to accumulate onto (bf16-representable for both dtypes).
  const size_t n_out = static_cast<size_t>(n * hidden);
  L.out_init.assign(n_out, 0.0f);
  if (spec.accumulate) {
    const std::vector<uint16_t> bits = testing::random_bf16(n_out, 1.0f, seed + 5, &L.out_init);
    if (spec.out_f32) {
      L.out_init_bytes.resize(n_out * 4);
      std::memcpy(L.out_init_bytes.data(), L.out_init.data(), n_out * 4);
    } else {
      L.out_init_bytes.resize(n_out * 2);
      std::memcpy(L.out_init_bytes.data(), bits.data(), n_out * 2);
    }
  } else {
    L.out_init_bytes.assign(n_out * (spec.out_f32 ? 4 : 2), 0xff);
  }
  L.d_out = cuda::DeviceBuffer(L.out_init_bytes.size());
  L.reset_out();
  BG_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// A blocking stream: the synchronous uploads and memsets (legacy default stream) are ordered before its work.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { BG_CUDA_CHECK(cudaStreamCreate(&s)); }
  ~Stream() { cudaStreamDestroy(s); }
};

// Captures one launch into a graph and replays it twice; each replay must give `want` bit for bit.
inline void expect_graph_replay_equals(const Launch& L, cudaStream_t stream, const std::vector<uint8_t>& want,
                                       const std::string& what) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BG_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  L.run(stream);
  BG_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  BG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    L.reset_out();
    BG_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    BG_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(L.download_bits() == want) << what << ": graph replay " << replay << " differs from eager";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Each row's unweighted expert output, rows in dispatch order (by expert, then (token, k)): the CPU reference run as
// top-1 with weight 1 over the gathered rows. p: rows-out params of the launch.
inline std::vector<float> rows_reference(const MoeW4a16Params& p, const ExpertSet& set,
                                         const std::vector<float>& x, const Routing& r) {
  const int64_t rows = p.n_tokens * p.top_k;
  std::vector<int32_t> row_expert;
  std::vector<float> x_rows, ones;
  for (int32_t e = 0; e < p.n_experts; ++e) {
    for (int64_t i = 0; i < rows; ++i) {
      if (r.ids[static_cast<size_t>(i)] != e) continue;
      row_expert.push_back(e);
      const auto* xt = x.data() + (i / p.top_k) * p.hidden;
      x_rows.insert(x_rows.end(), xt, xt + p.hidden);
      ones.push_back(1.0f);
    }
  }
  MoeW4a16Params q = p;
  q.rows_out = false;
  q.n_tokens = rows;
  q.top_k = 1;
  std::vector<float> ref(static_cast<size_t>(rows * p.hidden));
  moe_w4a16_cpu(q, set.views, x_rows.data(), row_expert.data(), ones.data(), ref.data());
  return ref;
}

}  // namespace bg::ops::w4a16_testing
