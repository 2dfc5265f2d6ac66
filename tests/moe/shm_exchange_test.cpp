// The shared-memory expert exchange (the ll slot layout on CPU) between ranks (threads with their own mappings),
// against the loopback: DeepEP-style structured payloads (each row carries its source rank and token, so a misrouted
// or duplicated row is an exact mismatch; the combine is checked against sum_k w * y), uneven token counts (ranks
// with none), several rounds per layer, and the whole MoE layer with real experts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "dist/rank_testing.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"
#include "moe/moe_layer.h"
#include "moe/moe_testing.h"
#include "moe/shm_exchange.h"
#include "ops/moe_exchange/moe_exchange.h"

namespace bg::moe {
namespace {

// One rank's routed tokens: x[t] = (rank, t, noise...), k distinct experts per token, weights in (0.1, 1).
struct RankTokens {
  int64_t n = 0;
  std::vector<float> x, w;
  std::vector<int32_t> ids;
};

RankTokens make_tokens(int64_t rank, int64_t n, int64_t E, int64_t k, int64_t hidden) {
  RankTokens r;
  r.n = n;
  std::mt19937_64 rng(static_cast<uint64_t>(100 + rank));
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t t = 0; t < n; ++t) {
    std::vector<int32_t> pool(static_cast<size_t>(E));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int64_t j = 0; j < k; ++j) {
      r.ids.push_back(pool[static_cast<size_t>(j)]);
      r.w.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(rng));
    }
    r.x.push_back(static_cast<float>(rank));
    r.x.push_back(static_cast<float>(t));
    for (int64_t i = 2; i < hidden; ++i) r.x.push_back(d(rng));
  }
  return r;
}

Tensor upload(Backend& be, const std::vector<float>& v, Shape shape) {
  Tensor t = be.alloc(std::move(shape), DType::kF32);
  if (!v.empty()) std::memcpy(t.data, v.data(), v.size() * sizeof(float));
  return t;
}

// Dense F32 identity-free experts with no weights needed: the test plays the experts (y = (e + 1) * x).
struct NoWeights {
  ExpertWeights weights;
  std::vector<std::unique_ptr<LinearHandle>> handles;
  std::vector<std::vector<float>> storage;
  NoWeights(Backend& be, int64_t E, int64_t hidden) {
    storage.reserve(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      storage.emplace_back(static_cast<size_t>(hidden * hidden), 0.0f);
      QuantWeight w{WeightFormat::kDense, hidden, hidden,
                    TensorView{DType::kF32, {hidden, hidden}, reinterpret_cast<const std::byte*>(storage.back().data()),
                               storage.back().size() * 4, "w"},
                    {}, "w", {}};
      handles.push_back(be.prepare_linear(w));
      weights.gate.push_back(handles.back().get());
      weights.up.push_back(handles.back().get());
      weights.down.push_back(handles.back().get());
    }
  }
};

struct Case {
  int32_t ranks;
  int64_t max_tokens;  // per call (rounds when a rank has more)
};

class ShmExchangeStructured : public ::testing::TestWithParam<Case> {};

TEST_P(ShmExchangeStructured, RowsArriveWhereTheyWereRoutedAndCombineIsTheWeightedSum) {
  const Case c = GetParam();
  const int64_t E = 16, k = 4, hidden = 8;
  dist::ParallelFlags f;
  f.ep = c.ranks;
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(f);
  std::vector<RankTokens> tokens;
  for (int32_t r = 0; r < c.ranks; ++r) tokens.push_back(make_tokens(r, r == 1 ? 0 : 3 + 5 * r, E, k, hidden));
  testing::run_ranks(layout, [&](dist::RankContext& ctx) {
    auto be = make_backend("cpu");
    const int32_t me = ctx.rank();
    const ExpertPlacement place = ExpertPlacement::contiguous(E, c.ranks, me);
    NoWeights w(*be, E, hidden);
    ExpertWeights mine;
    for (int64_t e = 0; e < E; ++e) {
      const bool here = place.owner(e) == me;
      mine.gate.push_back(here ? w.weights.gate[static_cast<size_t>(e)] : nullptr);
      mine.up.push_back(here ? w.weights.up[static_cast<size_t>(e)] : nullptr);
      mine.down.push_back(here ? w.weights.down[static_cast<size_t>(e)] : nullptr);
    }
    const ExpertTable table(*be, place, mine);
    ShmExchangeConfig cfg{ctx.world.get(), &ctx.shm->set(), place, k, hidden, c.max_tokens};
    auto ex = make_shm_exchange(cfg);
    const RankTokens& tk = tokens[static_cast<size_t>(me)];
    int64_t most = 0;
    for (const RankTokens& t : tokens) most = std::max(most, t.n);
    ex->set_step_tokens(most);
    std::vector<float> out(static_cast<size_t>(tk.n * hidden), 0.5f);
    const int64_t per = ex->max_tokens_per_call();
    for (int64_t round = 0; round < ex->step_rounds(); ++round) {
      const int64_t lo = std::min(tk.n, round * per), cnt = std::min(per, tk.n - lo);
      Tensor ids = upload_i32(*be, {tk.ids.begin() + lo * k, tk.ids.begin() + (lo + cnt) * k}, {cnt, k});
      Tensor wt = upload(*be, {tk.w.begin() + lo * k, tk.w.begin() + (lo + cnt) * k}, {cnt, k});
      Tensor x = upload(*be, {tk.x.begin() + lo * hidden, tk.x.begin() + (lo + cnt) * hidden}, {cnt, hidden});
      ExpertRows rows;
      ex->begin_dispatch(*be, table, {&ids, &wt, &x}, rows);
      ex->finish_dispatch(*be, rows);
      // Every received row is a token some rank routed to this slot's expert, and carries that token's row.
      const auto r = ops::moe_routing_layout(rows.routing.shape, rows.routing.buffer.data);
      std::map<std::tuple<int64_t, int64_t, int64_t>, int> seen;
      for (int64_t s = 0; s < table.n_slots(); ++s) {
        for (int32_t row = r.offsets[s]; row < r.offsets[s + 1]; ++row) {
          const int64_t o = rows.origin.as<int32_t>()[row], per_rank = per * k;
          const int64_t src = o / per_rank, t = o % per_rank / k + round * per, kk = o % k;
          const RankTokens& from = tokens[static_cast<size_t>(src)];
          ASSERT_LT(t, from.n) << "slot " << s << " row " << row;
          EXPECT_EQ(from.ids[static_cast<size_t>(t * k + kk)], table.expert_in(s));
          const float* got = rows.x.as<float>() + static_cast<int64_t>(row) * hidden;
          EXPECT_EQ(got[0], static_cast<float>(src));
          EXPECT_EQ(got[1], static_cast<float>(t));
          EXPECT_EQ(std::memcmp(got, from.x.data() + t * hidden, hidden * 4), 0);
          EXPECT_EQ(++seen[std::make_tuple(src, t, kk)], 1) << "duplicated row";
          // Play the expert: y = (e + 1) x.
          for (int64_t i = 0; i < hidden; ++i) {
            rows.y.as<float>()[static_cast<int64_t>(row) * hidden + i] = static_cast<float>(table.expert_in(s) + 1) * got[i];
          }
        }
      }
      // Nothing routed here is missing.
      int64_t expected = 0;
      for (int32_t src = 0; src < c.ranks; ++src) {
        const RankTokens& from = tokens[static_cast<size_t>(src)];
        for (int64_t t = std::min(from.n, round * per); t < std::min(from.n, (round + 1) * per); ++t) {
          for (int64_t j = 0; j < k; ++j) expected += place.owner(from.ids[static_cast<size_t>(t * k + j)]) == me;
        }
      }
      EXPECT_EQ(r.offsets[table.n_slots()], expected);
      Tensor o = upload(*be, {out.begin() + lo * hidden, out.begin() + (lo + cnt) * hidden}, {cnt, hidden});
      ex->begin_combine(*be, rows, o);
      ex->finish_combine(*be, o);
      if (cnt > 0) std::memcpy(out.data() + lo * hidden, o.data, static_cast<size_t>(cnt * hidden) * 4);
    }
    // out[t] = 0.5 + sum_k w (e + 1) x, in k order (exactly the combine's arithmetic).
    for (int64_t t = 0; t < tk.n; ++t) {
      for (int64_t i = 0; i < hidden; ++i) {
        float want = 0.5f;
        for (int64_t j = 0; j < k; ++j) {
          const auto e = static_cast<float>(tk.ids[static_cast<size_t>(t * k + j)] + 1);
          want += tk.w[static_cast<size_t>(t * k + j)] * (e * tk.x[static_cast<size_t>(t * hidden + i)]);
        }
        ASSERT_EQ(out[static_cast<size_t>(t * hidden + i)], want) << "rank " << me << " token " << t << " dim " << i;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmExchangeStructured,
                         ::testing::Values(Case{2, 64}, Case{4, 64}, Case{8, 64}, Case{4, 5}, Case{8, 3}),
                         [](const auto& param_info) {
                           return "ep" + std::to_string(param_info.param.ranks) + "_m" +
                                  std::to_string(param_info.param.max_tokens);
                         });

// The whole routed MoE layer (router choices given, real SwiGLU experts, several rounds) on 4 ranks equals the
// loopback over all experts on each rank's own tokens, bit for bit (every row meets the same expert arithmetic).
TEST(ShmExchange, MoeRoutedEqualsLoopbackWithRealExperts) {
  const int64_t E = 12, k = 3, hidden = 16, inter = 8;
  dist::ParallelFlags f;
  f.ep = 4;
  testing::run_ranks(dist::ParallelLayout::from_flags(f), [&](dist::RankContext& ctx) {
    auto be = make_backend("cpu");
    const int32_t me = ctx.rank();
    std::mt19937_64 rng(7);  // every rank draws all experts from one seed (test only) and keeps its own
    std::normal_distribution<float> d(0.0f, 0.5f);
    std::vector<std::vector<float>> store;
    std::vector<std::unique_ptr<LinearHandle>> handles;
    ExpertWeights all;
    store.reserve(static_cast<size_t>(3 * E));
    auto make = [&](int64_t out, int64_t in) {
      store.emplace_back(static_cast<size_t>(out * in));
      for (float& v : store.back()) v = d(rng);
      handles.push_back(be->prepare_linear(QuantWeight{
          WeightFormat::kDense, out, in,
          TensorView{DType::kF32, {out, in}, reinterpret_cast<const std::byte*>(store.back().data()),
                     store.back().size() * 4, "e"},
          {}, "e", {}}));
      return handles.back().get();
    };
    for (int64_t e = 0; e < E; ++e) {
      all.gate.push_back(make(inter, hidden));
      all.up.push_back(make(inter, hidden));
      all.down.push_back(make(hidden, inter));
    }
    MoeLayerWeights ep_w, one_w;
    const ExpertPlacement place = ExpertPlacement::contiguous(E, 4, me);
    ep_w.experts = ExpertTable(*be, place, all);
    one_w.experts = ExpertTable(*be, ExpertPlacement::contiguous(E, 1, 0), all);
    const MoeLayerSpec spec{{0, E, k, 1, 1, true, 1.0f}, {GluKind::kSwiGlu}};
    const RankTokens tk = make_tokens(me, me == 2 ? 0 : 4 + 3 * me, E, k, hidden);
    auto ex = make_shm_exchange({ctx.world.get(), &ctx.shm->set(), place, k, hidden, 4});  // 4 tokens per round
    ex->set_step_tokens(13);
    auto loop = make_loopback_exchange();
    const MoeChoice choice{upload_i32(*be, tk.ids, {tk.n, k}), upload(*be, tk.w, {tk.n, k})};
    Tensor x = upload(*be, tk.x, {tk.n, hidden});
    // The expert-parallel side overwrites (accumulate false: its NaN must not survive), the reference adds to zeros.
    Tensor out_ep = upload(*be, std::vector<float>(static_cast<size_t>(tk.n * hidden), std::nanf("")), {tk.n, hidden});
    Tensor out_one = be->zeros({tk.n, hidden}, DType::kF32);
    int overlaps = 0;
    moe_routed(*be, *ex, spec, ep_w, choice, x, out_ep, [&] { ++overlaps; }, /*accumulate=*/false);
    EXPECT_EQ(overlaps, 1);  // the shared experts run once, whatever the number of rounds
    if (tk.n > 0) moe_routed(*be, *loop, spec, one_w, choice, x, out_one, {});
    ASSERT_EQ(std::memcmp(out_ep.data, out_one.data, static_cast<size_t>(tk.n * hidden) * 4), 0) << "rank " << me;
  });
}

// The FP8 dispatch rounding of the CUDA ll-fp8 exchange (its GPU test compares against this function bit for bit):
// per group of 128 the largest magnitude survives to bf16 rounding, an all-zero group stays zero, every value is within
// e4m3's half-ulp (1/16 relative, or half the subnormal step scale * 2^-10) plus bf16's, and a hidden size that is not
// a multiple of 128 is refused.
TEST(LlFp8Dispatch, RoundingKeepsEachGroupsScaleAndStaysWithinE4m3Precision) {
  constexpr int64_t kHid = 384;
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(kHid);
  for (int64_t i = 0; i < kHid; ++i) x[i] = i < 128 ? d(rng) * 1e-3f : (i < 256 ? 0.0f : d(rng) * 50.0f);
  x[300] = -400.0f;  // the third group's amax
  std::vector<float> y = x;
  ops::ll_fp8_roundtrip_cpu(y.data(), kHid);
  for (int64_t g = 0; g < kHid; g += 128) {
    float amax = 0.0f;
    for (int64_t i = g; i < g + 128; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int64_t i = g; i < g + 128; ++i) {
      const float bound = std::max(std::fabs(x[i]) / 16.0f, scale * std::ldexp(1.0f, -10)) + std::fabs(x[i]) / 128.0f;
      EXPECT_LE(std::fabs(y[i] - x[i]), bound) << "value " << i << ": " << x[i] << " -> " << y[i];
      if (amax == 0.0f) {
        EXPECT_EQ(y[i], 0.0f);
      }
    }
  }
  EXPECT_NEAR(y[300], -400.0f, 400.0f / 128.0f);
  EXPECT_NE(y[0], x[0]);  // it does round: 3 mantissa bits
  std::vector<float> odd(200, 1.0f);
  EXPECT_THROW(ops::ll_fp8_roundtrip_cpu(odd.data(), 200), Error);
}

}  // namespace
}  // namespace bg::moe
