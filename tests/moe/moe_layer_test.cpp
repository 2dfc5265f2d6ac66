// The MoE layer on the CPU backend: expert placement over ranks, the expert -> slot table (including rewriting a slot
// as streamed experts will), the loopback exchange with structured payloads (each row encodes its token, each expert
// output its slot, so misrouting is an exact mismatch), and moe_routed against a direct per-token reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"
#include "moe/moe_layer.h"
#include "moe/moe_testing.h"

namespace bg::moe {
namespace {

TEST(ExpertPlacement, ContiguousRangesCoverEveryExpertOnce) {
  for (int64_t ranks : {1, 2, 4, 8, 16}) {
    std::vector<int> seen(896, 0);
    for (int64_t r = 0; r < ranks; ++r) {
      const ExpertPlacement p = ExpertPlacement::contiguous(896, ranks, r);
      EXPECT_EQ(p.n_local(), 896 / ranks);
      const std::vector<int32_t> map = p.local_slot_map();
      int32_t slot = 0;
      for (int32_t e : p.experts_of(r)) {
        ++seen[static_cast<size_t>(e)];
        EXPECT_EQ(p.owner(e), r);
        EXPECT_EQ(map[static_cast<size_t>(e)], slot++);
      }
      for (int64_t e = 0; e < 896; ++e) EXPECT_EQ(map[static_cast<size_t>(e)] >= 0, p.owner(e) == r);
    }
    for (int v : seen) EXPECT_EQ(v, 1);
  }
  EXPECT_EQ(ExpertPlacement::contiguous(10, 3, 2).n_local(), 2);  // ranges of 4, 4, 2
  EXPECT_THROW(ExpertPlacement::contiguous(4, 8, 0), Error);      // more ranks than experts
  EXPECT_THROW(ExpertPlacement::contiguous(9, 4, 0), Error);      // ranges of 3 leave the last rank empty
  EXPECT_THROW(ExpertPlacement::from_owners({0, 0, 2}, 3, 0), Error);  // rank 1 holds nothing
}

// Random dense F32 experts prepared on the backend (the test owns the storage and the handles).
struct TinyExperts {
  std::vector<std::vector<float>> storage;
  std::vector<std::unique_ptr<LinearHandle>> handles;
  ExpertWeights weights;
  TinyExperts(Backend& be, int64_t n_experts, int64_t hidden, int64_t inter, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> d(0.0f, 0.5f);
    auto make = [&](int64_t out, int64_t in) {
      storage.emplace_back(static_cast<size_t>(out * in));
      for (float& f : storage.back()) f = d(rng);
      QuantWeight w;
      w.format = WeightFormat::kDense;
      w.n_out = out;
      w.n_in = in;
      w.data.dtype = DType::kF32;
      w.data.shape = {out, in};
      w.data.data = reinterpret_cast<const std::byte*>(storage.back().data());
      w.data.nbytes = storage.back().size() * sizeof(float);
      handles.push_back(be.prepare_linear(w));
      return handles.back().get();
    };
    storage.reserve(static_cast<size_t>(3 * n_experts));
    for (int64_t e = 0; e < n_experts; ++e) {
      weights.gate.push_back(make(inter, hidden));
      weights.up.push_back(make(inter, hidden));
      weights.down.push_back(make(hidden, inter));
    }
  }
};

TEST(ExpertTable, SlotMapFollowsPlacementAndAssign) {
  auto be = make_backend("cpu");
  TinyExperts ex(*be, 8, 4, 4, 1);
  const ExpertPlacement p = ExpertPlacement::contiguous(8, 2, 1);  // rank 1 holds experts 4..7
  ExpertTable table(*be, p, ex.weights);
  EXPECT_EQ(table.n_slots(), 4);
  EXPECT_FALSE(table.all_local());  // an expert-parallel rank
  EXPECT_TRUE(ExpertTable(*be, ExpertPlacement::contiguous(8, 1, 0), ex.weights).all_local());
  std::vector<int32_t> map(8);
  std::memcpy(map.data(), table.slot_map().data, 8 * sizeof(int32_t));
  EXPECT_EQ(map, (std::vector<int32_t>{-1, -1, -1, -1, 0, 1, 2, 3}));
  EXPECT_EQ(table.expert_in(2), 6);
  // Slot 2 now holds expert 1 (as a streamed expert's arrival would): 6 leaves, 1 arrives.
  table.assign(*be, 2, 1, *ex.weights.gate[1], *ex.weights.up[1], *ex.weights.down[1]);
  std::memcpy(map.data(), table.slot_map().data, 8 * sizeof(int32_t));
  EXPECT_EQ(map, (std::vector<int32_t>{-1, 2, -1, -1, 0, 1, -1, 3}));
  EXPECT_EQ(table.expert_in(2), 1);
  EXPECT_THROW(table.assign(*be, 0, 1, *ex.weights.gate[1], *ex.weights.up[1], *ex.weights.down[1]), Error);
  EXPECT_THROW(table.assign(*be, 4, 2, *ex.weights.gate[2], *ex.weights.up[2], *ex.weights.down[2]), Error);
}

// A reference for out[t] += sum_k w(t,k) E_{id}(x[t]) with every expert applied to its token directly.
std::vector<float> direct_reference(Backend& be, const ExpertWeights& w, const GluSpec& glu, const std::vector<float>& x,
                                    const std::vector<int32_t>& ids, const std::vector<float>& wts, int64_t n,
                                    int64_t k, int64_t hidden, std::vector<float> out) {
  for (int64_t t = 0; t < n; ++t) {
    Tensor xt = be.upload_f32(std::span<const float>(x).subspan(static_cast<size_t>(t * hidden),
                                                                static_cast<size_t>(hidden)), {1, hidden}, DType::kF32);
    for (int64_t j = 0; j < k; ++j) {
      const auto e = static_cast<size_t>(ids[static_cast<size_t>(t * k + j)]);
      Tensor g = be.act(1, w.gate[e]->n_out()), u = be.act(1, w.gate[e]->n_out()), y = be.act(1, hidden);
      be.linear(*w.gate[e], xt, g);
      be.linear(*w.up[e], xt, u);
      be.glu(glu, g, u, g);
      be.linear(*w.down[e], g, y);
      const std::vector<float> yv = download(be, y);
      for (int64_t i = 0; i < hidden; ++i)
        out[static_cast<size_t>(t * hidden + i)] += wts[static_cast<size_t>(t * k + j)] * yv[static_cast<size_t>(i)];
    }
  }
  return out;
}

TEST(LoopbackExchange, RoutedEqualsDirectPerTokenExperts) {
  auto be = make_backend("cpu");
  const int64_t n = 37, k = 4, E = 12, hidden = 16, inter = 8;
  TinyExperts ex(*be, E, hidden, inter, 2);
  MoeLayerWeights w;
  w.experts = ExpertTable(*be, ExpertPlacement::contiguous(E, 1, 0), ex.weights);
  std::mt19937_64 rng(3);
  std::vector<int32_t> ids;
  std::vector<float> wts, x(static_cast<size_t>(n * hidden)), init(x.size());
  for (int64_t t = 0; t < n; ++t) {
    std::vector<int32_t> pool(static_cast<size_t>(E));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int64_t j = 0; j < k; ++j) {
      ids.push_back(pool[static_cast<size_t>(j)]);
      wts.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(rng));
    }
  }
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (float& f : x) f = d(rng);
  for (float& f : init) f = d(rng);
  for (GluKind kind : {GluKind::kSwiGlu, GluKind::kSitu}) {
    const MoeLayerSpec spec{{n, E, k, 1, 1, true, 1.0f}, {kind, 4.0f, 25.0f}};
    MoeChoice choice{upload_i32(*be, ids, {n, k}), be->upload_f32(wts, {n, k}, DType::kF32)};
    Tensor xt = be->upload_f32(x, {n, hidden}, DType::kF32), out = be->upload_f32(init, {n, hidden}, DType::kF32);
    auto exchange = make_loopback_exchange();
    bool overlapped = false;
    moe_routed(*be, *exchange, spec, w, choice, xt, out, [&] { overlapped = true; });
    EXPECT_TRUE(overlapped);
    const std::vector<float> got = download(*be, out);
    const std::vector<float> want = direct_reference(*be, ex.weights, spec.glu, x, ids, wts, n, k, hidden, init);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::fabs(want[i]))) << i;
    // accumulate false: `out` is overwritten (what it held, here NaN, must not survive).
    Tensor fresh = be->upload_f32(std::vector<float>(init.size(), std::nanf("")), {n, hidden}, DType::kF32);
    moe_routed(*be, *exchange, spec, w, choice, xt, fresh, {}, /*accumulate=*/false);
    const std::vector<float> got0 = download(*be, fresh);
    const std::vector<float> want0 = direct_reference(*be, ex.weights, spec.glu, x, ids, wts, n, k, hidden,
                                                      std::vector<float>(init.size(), 0.0f));
    for (size_t i = 0; i < got0.size(); ++i) ASSERT_NEAR(got0[i], want0[i], 1e-5 * (1.0 + std::fabs(want0[i]))) << i;
  }
}

TEST(LoopbackExchange, RowsCarryTheirTokens) {
  auto be = make_backend("cpu");
  const int64_t n = 9, k = 3, E = 5, hidden = 4;
  TinyExperts ex(*be, E, hidden, 4, 4);
  const ExpertTable table(*be, ExpertPlacement::contiguous(E, 1, 0), ex.weights);
  std::vector<int32_t> ids;
  std::vector<float> wts, x(static_cast<size_t>(n * hidden));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      ids.push_back(static_cast<int32_t>((t + 2 * j) % E));
      wts.push_back(1.0f);
    }
    for (int64_t i = 0; i < hidden; ++i) x[static_cast<size_t>(t * hidden + i)] = 100.0f * static_cast<float>(t) + static_cast<float>(i);
  }
  Tensor ti = upload_i32(*be, ids, {n, k}), tw = be->upload_f32(wts, {n, k}, DType::kF32);
  Tensor tx = be->upload_f32(x, {n, hidden}, DType::kF32);
  auto exchange = make_loopback_exchange();
  ExpertRows rows;
  exchange->begin_dispatch(*be, table, {&ti, &tw, &tx}, rows);
  exchange->finish_dispatch(*be, rows);
  const auto r = ops::moe_routing_layout(rows.routing.shape, rows.routing.buffer.data);
  const std::vector<float> got = download(*be, rows.x);
  for (int64_t s = 0; s < E; ++s) {
    for (int32_t row = r.offsets[s]; row < r.offsets[s + 1]; ++row) {
      const int32_t t = r.row_token[row];
      EXPECT_EQ(got[static_cast<size_t>(row * hidden)], 100.0f * static_cast<float>(t)) << "row " << row;
      bool routed_here = false;
      for (int64_t j = 0; j < k; ++j) routed_here |= ids[static_cast<size_t>(t * k + j)] == s;
      EXPECT_TRUE(routed_here) << "token " << t << " in slot " << s;
    }
  }
  // Combine of y = x (an identity "expert") with weight 1 gives k * x per token.
  be->copy(rows.x, rows.y);
  Tensor out = be->zeros({n, hidden}, DType::kF32);
  exchange->begin_combine(*be, rows, out);
  exchange->finish_combine(*be, out);
  const std::vector<float> combined = download(*be, out);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_FLOAT_EQ(combined[i], static_cast<float>(k) * x[i]);
}

// A rank with no tokens in a step (EP with DP attention; the nccl exchange test's reference on such a rank): the
// loopback and moe_routed take an empty [0, top_k] batch, move nothing and leave out as it was. (cols() of an empty
// tensor is 0: a routing shape made from it was refused with "top_k 0", first seen on two H200s.)
TEST(LoopbackExchange, AnEmptyBatchMovesNothing) {
  auto be = make_backend("cpu");
  const int64_t k = 3, E = 5, hidden = 4;
  TinyExperts ex(*be, E, hidden, 4, 4);
  MoeLayerWeights w;
  w.experts = ExpertTable(*be, ExpertPlacement::contiguous(E, 1, 0), ex.weights);
  Tensor ti = be->alloc({0, k}, DType::kI32), tw = be->alloc({0, k}, DType::kF32);
  Tensor tx = be->alloc({0, hidden}, DType::kF32), out = be->alloc({0, hidden}, DType::kF32);
  auto exchange = make_loopback_exchange();
  ExpertRows rows;
  ASSERT_NO_THROW(exchange->begin_dispatch(*be, w.experts, {&ti, &tw, &tx}, rows));
  EXPECT_EQ(rows.routing.shape.top_k, k);
  EXPECT_EQ(rows.x.rows(), 0);
  exchange->finish_dispatch(*be, rows);
  ASSERT_NO_THROW(exchange->begin_combine(*be, rows, out));
  exchange->finish_combine(*be, out);
  const MoeLayerSpec spec{{0, E, k, 1, 1, true, 1.0f}, {GluKind::kSwiGlu, 4.0f, 25.0f}};
  MoeChoice choice{ti, tw};
  EXPECT_NO_THROW(moe_routed(*be, *exchange, spec, w, choice, tx, out, [] {}));
}

}  // namespace
}  // namespace bg::moe
