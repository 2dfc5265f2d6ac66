// MoE stages on the CPU against independent formulas: dispatch groups exactly the local pairs by slot, stably, with
// counts / offsets / tile offsets / active list consistent; gather copies rows; experts equal the per-row FFN in
// double precision; combine equals sum_k w y in double precision; bad ids and missing slots are errors. Payloads encode
// (token, k) so that routing mistakes show as exact mismatches.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/moe/moe.h"

namespace bg::ops {
namespace {

struct Routing {
  MoeRoutingShape shape;
  std::vector<int32_t> ids, slot_map;
  std::vector<float> weights;
  std::vector<std::byte> buf;
  MoeRoutingArrays r;

  Routing(int64_t n, int64_t k, int64_t E, int64_t stride, uint64_t seed) {
    std::mt19937_64 rng(seed);
    shape = {n, k, E, (E + stride - 1) / stride, stride == 1};
    slot_map.assign(static_cast<size_t>(E), -1);
    for (int64_t e = 0, s = 0; e < E; e += stride) slot_map[static_cast<size_t>(e)] = static_cast<int32_t>(s++);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> pool(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) pool[static_cast<size_t>(e)] = static_cast<int32_t>(e);
      std::shuffle(pool.begin(), pool.end(), rng);
      for (int64_t j = 0; j < k; ++j) {
        ids.push_back(pool[static_cast<size_t>(j)]);
        weights.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(rng));
      }
    }
    buf.resize(moe_routing_bytes(shape) + 64);
    auto base = (reinterpret_cast<uintptr_t>(buf.data()) + 63) / 64 * 64;
    r = moe_routing_layout(shape, reinterpret_cast<void*>(base));
    moe_dispatch_cpu(shape, slot_map.data(), ids.data(), weights.data(), r);
  }
};

TEST(MoeCpu, DispatchGroupsLocalPairsBySlotStably) {
  for (int64_t stride : {1, 3, 16}) {
    for (int64_t n : {0, 1, 7, 300}) {
      const Routing g(n, 8, 64, stride, 11 + static_cast<uint64_t>(n));
      const MoeRoutingArrays& r = g.r;
      const int64_t S = g.shape.n_slots;
      // Independent count of each slot's pairs.
      std::vector<int32_t> want(static_cast<size_t>(S), 0);
      for (int32_t id : g.ids) {
        if (g.slot_map[static_cast<size_t>(id)] >= 0) ++want[static_cast<size_t>(g.slot_map[static_cast<size_t>(id)])];
      }
      int32_t off = 0, tiles = 0, n_active = 0;
      for (int64_t s = 0; s < S; ++s) {
        ASSERT_EQ(r.counts[s], want[static_cast<size_t>(s)]) << "slot " << s;
        ASSERT_EQ(r.offsets[s], off);
        ASSERT_EQ(r.tile_offsets[s], tiles);
        if (want[static_cast<size_t>(s)] > 0) {
          ASSERT_EQ(r.active[n_active++], s);
        }
        off += want[static_cast<size_t>(s)];
        tiles += (want[static_cast<size_t>(s)] + kMoeTileRows - 1) / kMoeTileRows;
      }
      ASSERT_EQ(r.offsets[S], off);
      ASSERT_EQ(*r.n_active, n_active);
      if (stride == 1) {
        ASSERT_EQ(off, n * 8);
      }
      // Every pair: local ones land in their slot's range, in (token, k) order; remote ones have no row.
      std::vector<int32_t> last_pair(static_cast<size_t>(S), -1);
      for (int64_t i = 0; i < g.shape.n_pairs(); ++i) {
        const int32_t slot = g.slot_map[static_cast<size_t>(g.ids[static_cast<size_t>(i)])];
        const int32_t row = r.slot_row[i];
        if (slot < 0) {
          ASSERT_EQ(row, -1);
          continue;
        }
        ASSERT_GE(row, r.offsets[slot]);
        ASSERT_LT(row, r.offsets[slot + 1]);
        ASSERT_EQ(r.row_token[row], i / 8);
        ASSERT_EQ(r.row_weight[row], g.weights[static_cast<size_t>(i)]);
        ASSERT_GT(i, last_pair[static_cast<size_t>(slot)]);  // stable
        ASSERT_EQ(row - r.offsets[slot], [&] {  // rank among the slot's earlier pairs
          int32_t c = 0;
          for (int64_t j = 0; j < i; ++j) c += g.slot_map[static_cast<size_t>(g.ids[static_cast<size_t>(j)])] == slot;
          return c;
        }());
        last_pair[static_cast<size_t>(slot)] = static_cast<int32_t>(i);
      }
    }
  }
}

TEST(MoeCpu, GatherAndCombineMoveExactlyTheEncodedRows) {
  const int64_t n = 50, k = 4, E = 24, dim = 6;
  for (int64_t stride : {1, 2}) {
    const Routing g(n, k, E, stride, 21);
    // x[t] = (t, t + 0.5, ...): every gathered row names its token.
    std::vector<float> x(static_cast<size_t>(n * dim)), rows(static_cast<size_t>(n * k * dim), NAN);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < dim; ++i) x[static_cast<size_t>(t * dim + i)] = static_cast<float>(t) + 0.5f * static_cast<float>(i);
    moe_gather_cpu(g.shape, g.r, x.data(), dim, rows.data());
    for (int32_t row = 0; row < g.r.offsets[g.shape.n_slots]; ++row)
      for (int64_t i = 0; i < dim; ++i)
        ASSERT_EQ(rows[static_cast<size_t>(row * dim + i)], x[static_cast<size_t>(g.r.row_token[row] * dim + i)]);
    // y[row] encodes (slot of the row, token): combine must add w * y over exactly the local pairs.
    std::vector<float> y(rows.size());
    for (int32_t row = 0; row < g.r.offsets[g.shape.n_slots]; ++row)
      for (int64_t i = 0; i < dim; ++i) y[static_cast<size_t>(row * dim + i)] = 1000.0f * static_cast<float>(row) + static_cast<float>(i);
    std::vector<float> out(static_cast<size_t>(n * dim), 1.0f);
    moe_combine_cpu(g.shape, g.r, y.data(), dim, out.data());
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < dim; ++i) {
        double want = 1.0;
        for (int64_t j = 0; j < k; ++j) {
          const int32_t id = g.ids[static_cast<size_t>(t * k + j)];
          if (g.slot_map[static_cast<size_t>(id)] < 0) continue;
          const int32_t row = g.r.slot_row[t * k + j];
          want += static_cast<double>(g.weights[static_cast<size_t>(t * k + j)]) * (1000.0 * row + static_cast<double>(i));
        }
        ASSERT_NEAR(out[static_cast<size_t>(t * dim + i)], want, 1e-6 * std::fabs(want) + 1e-3) << t << " " << i;
      }
    }
  }
}

// Dense F32 expert weights as QuantWeights over owned storage.
struct DenseExpert {
  std::vector<float> gate, up, down;
  QuantWeight qg, qu, qd;
  static QuantWeight view(std::vector<float>& v, int64_t out, int64_t in) {
    QuantWeight w;
    w.format = WeightFormat::kDense;
    w.n_out = out;
    w.n_in = in;
    w.data.dtype = DType::kF32;
    w.data.shape = {out, in};
    w.data.data = reinterpret_cast<const std::byte*>(v.data());
    w.data.nbytes = v.size() * sizeof(float);
    return w;
  }
  DenseExpert(int64_t hidden, int64_t inter, std::mt19937_64& rng) {
    std::normal_distribution<float> d(0.0f, 0.3f);
    for (auto* v : {&gate, &up}) {
      v->resize(static_cast<size_t>(inter * hidden));
      for (float& f : *v) f = d(rng);
    }
    down.resize(static_cast<size_t>(hidden * inter));
    for (float& f : down) f = d(rng);
    qg = view(gate, inter, hidden);
    qu = view(up, inter, hidden);
    qd = view(down, hidden, inter);
  }
};

TEST(MoeCpu, ExpertsMatchPerRowFfnInDouble) {
  const int64_t n = 20, k = 3, E = 6, hidden = 16, inter = 8;
  std::mt19937_64 rng(5);
  std::vector<DenseExpert> experts;
  for (int64_t e = 0; e < E; ++e) experts.emplace_back(hidden, inter, rng);
  for (MoeGlu kind : {MoeGlu::kSwiGlu, MoeGlu::kSitu}) {
    const Routing g(n, k, E, 1, 31);
    std::vector<MoeExpertCpu> slots;
    for (auto& e : experts) slots.push_back({&e.qg, &e.qu, &e.qd});
    std::vector<float> rows(static_cast<size_t>(n * k * hidden)), y(rows.size(), NAN);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (float& f : rows) f = d(rng);
    const MoeGluParams glu{kind, 4.0f, 25.0f};
    moe_experts_cpu(g.shape, g.r, slots, glu, rows.data(), y.data(), false);
    for (int64_t s = 0; s < E; ++s) {
      const DenseExpert& w = experts[static_cast<size_t>(s)];
      for (int32_t row = g.r.offsets[s]; row < g.r.offsets[s + 1]; ++row) {
        const float* xr = rows.data() + row * hidden;
        std::vector<double> h(static_cast<size_t>(inter));
        for (int64_t j = 0; j < inter; ++j) {
          double gs = 0, us = 0;
          for (int64_t i = 0; i < hidden; ++i) {
            gs += static_cast<double>(w.gate[static_cast<size_t>(j * hidden + i)]) * xr[i];
            us += static_cast<double>(w.up[static_cast<size_t>(j * hidden + i)]) * xr[i];
          }
          const double sig = 1.0 / (1.0 + std::exp(-gs));
          h[static_cast<size_t>(j)] = kind == MoeGlu::kSwiGlu
                                          ? gs * sig * us
                                          : 4.0 * std::tanh(gs / 4.0) * sig * (25.0 * std::tanh(us / 25.0));
        }
        for (int64_t i = 0; i < hidden; ++i) {
          double o = 0;
          for (int64_t j = 0; j < inter; ++j) o += static_cast<double>(w.down[static_cast<size_t>(i * inter + j)]) * h[static_cast<size_t>(j)];
          ASSERT_NEAR(y[static_cast<size_t>(row * hidden + i)], o, 1e-4 * (1.0 + std::fabs(o))) << "slot " << s;
        }
      }
    }
  }
}

TEST(MoeCpu, RejectsBadRouting) {
  Routing g(4, 2, 8, 1, 41);
  g.ids[3] = 8;  // out of range
  EXPECT_THROW(moe_dispatch_cpu(g.shape, g.slot_map.data(), g.ids.data(), g.weights.data(), g.r), Error);
  Routing h(4, 2, 8, 2, 42);  // half the experts elsewhere
  h.shape.all_local = true;   // ... but every expert must be here
  bool any_remote = false;
  for (int32_t id : h.ids) any_remote |= h.slot_map[static_cast<size_t>(id)] < 0;
  ASSERT_TRUE(any_remote);
  EXPECT_THROW(moe_dispatch_cpu(h.shape, h.slot_map.data(), h.ids.data(), h.weights.data(), h.r), Error);
  EXPECT_THROW(moe_routing_bytes({4, 40, 64, 64, true}), Error);   // top_k above the limit
  EXPECT_THROW(moe_routing_bytes({4, 2, 8, 9, true}), Error);      // more slots than experts
}

// Padding rows (a decode graph's filler, live_tokens on): their pairs get no row and their ids are not read; the
// live rows are routed exactly as in a dispatch of the live tokens alone.
TEST(MoeCpu, DispatchDropsPaddingRows) {
  for (const int64_t live : {0, 5, 9, 12}) {
    Routing g(12, 4, 16, 1, 50 + static_cast<uint64_t>(live));
    const Routing alone(live, 4, 16, 1, 50 + static_cast<uint64_t>(live));  // the same first `live` tokens' ids
    for (int64_t i = live * 4; i < 48; ++i) g.ids[static_cast<size_t>(i)] = -9;  // never read: no error
    moe_dispatch_cpu(g.shape, g.slot_map.data(), g.ids.data(), g.weights.data(), g.r, live);
    for (int64_t s = 0; s < 16; ++s) ASSERT_EQ(g.r.counts[s], alone.r.counts[s]) << "live " << live << " slot " << s;
    ASSERT_EQ(g.r.offsets[16], live * 4);
    ASSERT_EQ(*g.r.n_active, *alone.r.n_active);
    for (int64_t i = 0; i < 48; ++i) {
      ASSERT_EQ(g.r.slot_row[i], i < live * 4 ? alone.r.slot_row[i] : -1) << "live " << live << " pair " << i;
    }
    for (int32_t row = 0; row < g.r.offsets[16]; ++row) ASSERT_EQ(g.r.row_token[row], alone.r.row_token[row]);
  }
}

}  // namespace
}  // namespace bg::ops
