// Shared pieces of the MoE parity tests (moe_cuda_parity_test, moe_grouped_parity_test): random top-k routings, slot
// maps, a poisoned device workspace, the CPU reference routing, random experts in each stored format with their
// device descriptor table, and the CPU reference of the whole routed path.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "ops/moe/moe.h"
#include "ops/moe/moe_cuda.h"

namespace bg::ops::moe_testing {

using testing::HostWeight;

template <typename T>
inline std::vector<T> download_ptr(const T* p, size_t n) {
  std::vector<T> out(n);
  if (n > 0) BG_CUDA_CHECK(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

// Top-k routing: each token picks k distinct experts from [0, n_used) with positive weights.
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

inline Routing random_routing(int64_t n, int64_t k, int64_t n_used, uint64_t seed) {
  Routing r;
  std::vector<int32_t> pool(static_cast<size_t>(n_used));
  for (int64_t t = 0; t < n; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t j = 0; j < k; ++j) {  // partial Fisher-Yates
      const uint64_t h = testing::mix64(seed ^ testing::mix64(static_cast<uint64_t>(t * 64 + j)));
      const int64_t pick = j + static_cast<int64_t>(h % static_cast<uint64_t>(n_used - j));
      std::swap(pool[static_cast<size_t>(j)], pool[static_cast<size_t>(pick)]);
      r.ids.push_back(pool[static_cast<size_t>(j)]);
      r.weights.push_back(0.55f + testing::hash_uniform(seed + 7, static_cast<uint64_t>(t * k + j), 0.45f));
    }
  }
  return r;
}

// Identity slot map (one rank) or a map where every `stride`-th expert is local (slots in expert order), the rest -1.
inline std::vector<int32_t> slot_map_every(int64_t n_experts, int64_t stride) {
  std::vector<int32_t> map(static_cast<size_t>(n_experts), -1);
  int32_t next = 0;
  for (int64_t e = 0; e < n_experts; e += stride) map[static_cast<size_t>(e)] = next++;
  return map;
}

// Device workspace for p: routing arrays, slot map, row buffers and error word, poisoned (0xff) so that nothing
// passes by reading stale zeros.
struct Workspace {
  cuda::DeviceBuffer routing, map, x_perm, h, y_perm, errors;
  MoeWorkspace ws;
  Workspace(const MoeCudaParams& p, const std::vector<int32_t>& slot_map)
      : routing(moe_routing_bytes(p.shape)),
        map(cuda::upload(slot_map)),
        x_perm(static_cast<size_t>(std::max<int64_t>(1, p.shape.n_pairs() * p.hidden)) * 2),
        h(static_cast<size_t>(std::max<int64_t>(1, p.shape.n_pairs() * p.inter)) * 2),
        y_perm(static_cast<size_t>(std::max<int64_t>(1, p.shape.n_pairs() * p.hidden)) * 2),
        errors(sizeof(int32_t)) {
    for (cuda::DeviceBuffer* b : {&routing, &x_perm, &h, &y_perm}) b->fill_bytes(0xff);
    errors.fill_bytes(0);
    static_cast<MoeRoutingArrays&>(ws) = moe_routing_layout(p.shape, routing.data());
    ws.slot_map = map.as<int32_t>();
    ws.x_perm = x_perm.as<__nv_bfloat16>();
    ws.h = h.as<__nv_bfloat16>();
    ws.y_perm = y_perm.as<__nv_bfloat16>();
    ws.error_flags = errors.as<int32_t>();
  }
  int32_t error_word() const { return cuda::download<int32_t>(errors, 1)[0]; }
};

// The CPU reference routing of the same shape (host buffer in the same layout).
struct HostRouting {
  std::vector<std::byte> buf;
  MoeRoutingArrays r;
  // live_tokens >= 0: the tokens from there on are padding (moe_dispatch_cpu).
  HostRouting(const MoeRoutingShape& s, const std::vector<int32_t>& slot_map, const Routing& routing,
              int64_t live_tokens = -1)
      : buf(moe_routing_bytes(s) + 64) {
    auto base = reinterpret_cast<uintptr_t>(buf.data());
    r = moe_routing_layout(s, reinterpret_cast<void*>((base + 63) / 64 * 64));
    moe_dispatch_cpu(s, slot_map.data(), routing.ids.data(), routing.weights.data(), r, live_tokens);
  }
};

inline MoeCudaParams params(int64_t n, int64_t k, int64_t E, int64_t slots, int64_t hidden, int64_t inter) {
  MoeCudaParams p;
  p.shape = {n, k, E, slots, slots == E};
  p.hidden = hidden;
  p.inter = inter;
  p.expert_format = WeightFormat::kDense;
  return p;
}

// What make_experts needs of a case.
struct ExpertShape {
  int64_t n_experts = 0, hidden = 0, inter = 0;
  WeightFormat format = WeightFormat::kMxfp4;
};

struct Experts {
  std::vector<HostWeight> gate, up, down;
  std::vector<DeviceWeightStorage> storage;
  std::vector<MoeExpertCpu> cpu;
  cuda::DeviceBuffer table;  // ExpertWeightsCuda [n_experts]
};

inline Experts make_experts(const ExpertShape& c, uint64_t seed) {
  Experts ex;
  std::vector<ExpertWeightsCuda> descs;
  const size_t E = static_cast<size_t>(c.n_experts);
  ex.gate.reserve(E);
  ex.up.reserve(E);
  ex.down.reserve(E);
  ex.storage.reserve(3 * E);
  const float s_in = 1.0f / std::sqrt(static_cast<float>(c.hidden));
  const float s_mid = 2.0f / std::sqrt(static_cast<float>(c.inter));
  for (int64_t e = 0; e < c.n_experts; ++e) {
    const uint64_t base = seed * 1000 + static_cast<uint64_t>(e) * 3;
    ex.gate.push_back(testing::random_weight(c.format, c.inter, c.hidden, s_in, base));
    ex.up.push_back(testing::random_weight(c.format, c.inter, c.hidden, s_in, base + 1));
    ex.down.push_back(testing::random_weight(c.format, c.hidden, c.inter, s_mid, base + 2));
    ExpertWeightsCuda d;
    ex.storage.push_back(upload_weight(ex.gate.back().w));
    d.gate = ex.storage.back().desc;
    ex.storage.push_back(upload_weight(ex.up.back().w));
    d.up = ex.storage.back().desc;
    ex.storage.push_back(upload_weight(ex.down.back().w));
    d.down = ex.storage.back().desc;
    descs.push_back(d);
  }
  ex.table = cuda::upload_bytes(descs.data(), descs.size() * sizeof(ExpertWeightsCuda));
  for (size_t e = 0; e < E; ++e) ex.cpu.push_back({&ex.gate[e].w, &ex.up[e].w, &ex.down[e].w});
  return ex;
}

// The CPU stages on the same inputs: out = sum_k w E(x) (fp32).
inline std::vector<float> reference_moe(const MoeCudaParams& p, const Experts& ex, const Routing& r,
                                 const std::vector<float>& x) {
  const std::vector<int32_t> map = slot_map_every(p.shape.n_experts, 1);
  const HostRouting ref(p.shape, map, r);
  const size_t rows_n = static_cast<size_t>(p.shape.n_pairs() * p.hidden);
  std::vector<float> rows(rows_n), y(rows_n), out(static_cast<size_t>(p.shape.n_tokens * p.hidden), 0.0f);
  moe_gather_cpu(p.shape, ref.r, x.data(), p.hidden, rows.data());
  moe_experts_cpu(p.shape, ref.r, ex.cpu, p.act, rows.data(), y.data(), false);
  moe_combine_cpu(p.shape, ref.r, y.data(), p.hidden, out.data());
  return out;
}


}  // namespace bg::ops::moe_testing
