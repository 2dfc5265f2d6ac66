// Shared by the CUDA expert-exchange tests (nccl, ll): expert handles nobody multiplies (the test plays the experts,
// y = x) and one exchange call whose combine result is compared with the loopback's.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"

namespace bg::moe::exchange_testing {

constexpr int64_t kExperts = 16, kTopK = 4, kHidden = 256;

// Dense expert weights nobody multiplies (the test plays the experts); the table only needs handles.
struct Handles {
  ExpertWeights all;
  std::vector<std::unique_ptr<LinearHandle>> owned;
  std::vector<float> zeros = std::vector<float>(static_cast<size_t>(kHidden * kHidden), 0.0f);
  explicit Handles(Backend& be) {
    for (int64_t e = 0; e < kExperts; ++e) {
      QuantWeight w{WeightFormat::kDense, kHidden, kHidden,
                    TensorView{DType::kF32, {kHidden, kHidden}, reinterpret_cast<const std::byte*>(zeros.data()),
                               zeros.size() * 4, "w"},
                    {}, "w", {}};
      owned.push_back(be.prepare_linear(w));
      all.gate.push_back(owned.back().get());
      all.up.push_back(owned.back().get());
      all.down.push_back(owned.back().get());
    }
  }
  ExpertWeights of(const ExpertPlacement& p) const {
    ExpertWeights m;
    for (int64_t e = 0; e < kExperts; ++e) {
      const bool here = p.owner(e) == p.rank();
      m.gate.push_back(here ? all.gate[static_cast<size_t>(e)] : nullptr);
      m.up.push_back(here ? all.up[static_cast<size_t>(e)] : nullptr);
      m.down.push_back(here ? all.down[static_cast<size_t>(e)] : nullptr);
    }
    return m;
  }
};

// One call's inputs on the backend: ids [n, top_k], weights, rows x [n, hidden] (bf16) and out (initially `init`).
struct CallTensors {
  int64_t n = 0;
  Tensor ids, weights, x, out;
  CallTensors(Backend& be, const std::vector<int32_t>& id, const std::vector<float>& w, const std::vector<float>& xs,
              const std::vector<float>& init)
      : n(static_cast<int64_t>(xs.size()) / kHidden), ids(be.alloc({n, kTopK}, DType::kI32)) {
    if (n > 0) be.write_bytes(ids, std::as_bytes(std::span<const int32_t>(id)));
    weights = n > 0 ? be.upload_f32(w, {n, kTopK}, DType::kF32) : be.alloc({0, kTopK}, DType::kF32);
    x = n > 0 ? be.upload_f32(xs, {n, kHidden}, DType::kBF16) : be.alloc({0, kHidden}, DType::kBF16);
    out = n > 0 ? be.upload_f32(init, {n, kHidden}, DType::kBF16) : be.alloc({0, kHidden}, DType::kBF16);
  }
  std::vector<float> download(Backend& be) const {
    std::vector<float> got(static_cast<size_t>(n * kHidden));
    if (n > 0) be.download_f32(out, got.data());
    be.synchronize();
    return got;
  }
};

// One exchange call with y = x; returns out (initially `init`) after the combine, as floats.
inline std::vector<float> exchange_once(Backend& be, Exchange& ex, const ExpertTable& table,
                                        const std::vector<int32_t>& ids, const std::vector<float>& w,
                                        const std::vector<float>& x, const std::vector<float>& init) {
  CallTensors t(be, ids, w, x, init);
  ExpertRows rows;
  ex.begin_dispatch(be, table, {&t.ids, &t.weights, &t.x}, rows);
  ex.finish_dispatch(be, rows);
  be.copy(rows.x, rows.y);
  ex.begin_combine(be, rows, t.out);
  ex.finish_combine(be, t.out);
  return t.download(be);
}

}  // namespace bg::moe::exchange_testing
