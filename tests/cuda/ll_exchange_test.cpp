// The ll expert exchange (moe/cuda/ll_exchange.cu) between ranks that share this process and GPU: each rank is a
// thread with its own CUDA backend (and stream); the regions are device allocations every rank addresses directly
// (between processes they come through CUDA IPC, with the same kernels). The test plays the experts (y = x), so
// every rank's combine must give the loopback's bits exactly: over several calls (both buffer parities), uneven token
// counts, a rank without tokens, uneven placements and unrouted pairs (id -1). A bad expert id is reported through the
// backend's error flags without hanging any rank, and the next call works.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "cuda/cuda_testing.h"
#include "cuda/exchange_testing.h"
#include "moe/cuda_exchange.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"

namespace bg::moe {
namespace {

using namespace exchange_testing;  // NOLINT: the shared fixtures of the exchange tests

constexpr int64_t kMaxTokens = 48;

struct Placement {
  std::string name;
  int32_t world;
  std::vector<int32_t> owner;  // empty: contiguous ranges
};

ExpertPlacement place_of(const Placement& p, int32_t rank) {
  return p.owner.empty() ? ExpertPlacement::contiguous(kExperts, p.world, rank)
                         : ExpertPlacement::from_owners(p.owner, p.world, rank);
}

// Every rank's region, cleared; freed at the end of the test.
struct Regions {
  std::vector<std::byte*> p;
  Regions(int32_t world, size_t bytes) {
    for (int32_t r = 0; r < world; ++r) {
      void* q = nullptr;
      EXPECT_EQ(cudaMalloc(&q, bytes), cudaSuccess);
      EXPECT_EQ(cudaMemset(q, 0, bytes), cudaSuccess);
      p.push_back(static_cast<std::byte*>(q));
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~Regions() {
    for (std::byte* q : p) cudaFree(q);
  }
};

LlExchangeConfig config_of(const ExpertPlacement& place) {
  LlExchangeConfig c;
  c.placement = place;
  c.top_k = kTopK;
  c.hidden = kHidden;
  c.max_tokens = kMaxTokens;
  c.timeout_s = 30.0;  // a broken test fails (the waiting rank traps) instead of hanging
  return c;
}

// Runs body(rank, backend, exchange, table of this rank, table of one rank) on one thread per rank.
void run_ll_ranks(const Placement& pl,
                  const std::function<void(int32_t, Backend&, Exchange&, const ExpertTable&, const ExpertTable&)>& body) {
  const size_t bytes = ll_exchange_region_bytes(config_of(place_of(pl, 0)));
  Regions regions(pl.world, bytes);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < pl.world; ++r) {
    threads.emplace_back([&, r] {
      auto be = make_cuda_backend();
      Handles h(*be);
      const ExpertPlacement place = place_of(pl, r);
      const ExpertPlacement one = ExpertPlacement::contiguous(kExperts, 1, 0);
      const ExpertTable table(*be, place, h.of(place)), table_one(*be, one, h.all);
      auto ex = make_ll_exchange(*be, config_of(place), LlPeerRegions{regions.p, nullptr});
      EXPECT_EQ(ex->max_tokens_per_call(), kMaxTokens);
      body(r, *be, *ex, table, table_one);
      be->synchronize();
    });
  }
  for (auto& t : threads) t.join();
}

// Token t's top-k distinct experts with weights; `unrouted` of them -1.
void route(std::mt19937& rng, int64_t n, int unrouted, std::vector<int32_t>& ids, std::vector<float>& w) {
  for (int64_t t = 0; t < n; ++t) {
    std::vector<int32_t> e(kExperts);
    std::iota(e.begin(), e.end(), 0);
    std::shuffle(e.begin(), e.end(), rng);
    for (int64_t k = 0; k < kTopK; ++k) {
      ids.push_back(k < unrouted && t % 3 == 0 ? -1 : e[static_cast<size_t>(k)]);
      w.push_back(0.1f + 0.9f * std::uniform_real_distribution<float>()(rng));
    }
  }
}

class LlExchangeRanks : public ::testing::TestWithParam<Placement> {};

TEST_P(LlExchangeRanks, EqualsTheLoopbackBitForBitOnEveryRank) {
  BG_REQUIRE_GPU();
  const Placement& pl = GetParam();
  run_ll_ranks(pl, [&](int32_t me, Backend& be, Exchange& ex, const ExpertTable& table, const ExpertTable& one) {
    auto loop = make_loopback_exchange();
    std::mt19937 rng(static_cast<uint32_t>(4321 + me));
    for (int call = 0; call < 5; ++call) {  // five epochs: both parities, each reused
      const int64_t n = me == 1 && call == 1 ? 0 : std::min<int64_t>(kMaxTokens, 3 + 11 * me + 7 * call);
      std::vector<int32_t> ids;
      std::vector<float> w, x = testing::random_floats(static_cast<size_t>(n * kHidden), 1.0f, rng());
      const std::vector<float> init = testing::random_floats(x.size(), 0.5f, rng());
      route(rng, n, call % 2 == 0 ? 1 : 0, ids, w);
      const std::vector<float> got = exchange_once(be, ex, table, ids, w, x, init);
      const std::vector<float> ref = exchange_once(be, *loop, one, ids, w, x, init);
      ASSERT_EQ(got.size(), ref.size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i])) << "rank " << me << " value " << i;
        ASSERT_EQ(std::memcmp(&got[i], &ref[i], 4), 0) << pl.name << " rank " << me << " call " << call << " value "
                                                       << i << ": " << got[i] << " vs " << ref[i];
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Placements, LlExchangeRanks,
    ::testing::Values(Placement{"two_ranks", 2, {}}, Placement{"four_ranks", 4, {}},
                      // rank 0 holds one expert, rank 2 most of them
                      Placement{"uneven_three", 3, {0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 2, 2}}),
    [](const auto& param_info) { return param_info.param.name; });

TEST(LlExchange, ABadExpertIdIsReportedAndTheNextCallWorks) {
  BG_REQUIRE_GPU();
  run_ll_ranks(Placement{"two", 2, {}}, [&](int32_t me, Backend& be, Exchange& ex, const ExpertTable& table,
                                             const ExpertTable& one) {
    auto loop = make_loopback_exchange();
    std::mt19937 rng(static_cast<uint32_t>(99 + me));
    const int64_t n = 6;
    std::vector<int32_t> ids;
    std::vector<float> w, x = testing::random_floats(static_cast<size_t>(n * kHidden), 1.0f, rng());
    const std::vector<float> init(x.size(), 0.0f);
    route(rng, n, 0, ids, w);
    std::vector<int32_t> bad = ids;
    if (me == 0) bad[5] = static_cast<int32_t>(kExperts);  // out of range: dropped, flagged on rank 0
    if (me == 0) {
      try {
        exchange_once(be, ex, table, bad, w, x, init);
        ADD_FAILURE() << "a routed id outside the experts was not reported";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("outside the layer's experts"), std::string::npos) << e.what();
      }
    } else {
      exchange_once(be, ex, table, bad, w, x, init);
    }
    const std::vector<float> got = exchange_once(be, ex, table, ids, w, x, init);
    const std::vector<float> ref = exchange_once(be, *loop, one, ids, w, x, init);
    ASSERT_EQ(std::memcmp(got.data(), ref.data(), got.size() * 4), 0) << "rank " << me;
  });
}

TEST(LlExchange, ShapeFollowsThePlacementAndTheBudget) {
  // Host-side only: no GPU needed.
  LlExchangeConfig c;
  c.placement = ExpertPlacement::contiguous(56, 8, 3);
  c.top_k = 16;
  c.hidden = 7168;
  c.region_budget_bytes = int64_t{1} << 30;
  const ops::LlShape s = ll_exchange_shape(c);
  EXPECT_EQ(s.n_ranks, 8);
  EXPECT_EQ(s.n_local, 7);
  EXPECT_EQ(s.row_elem_bytes, 2);
  EXPECT_GE(s.max_tokens, 1);
  EXPECT_LE(s.max_tokens, kLlMaxTokens);
  EXPECT_LE(static_cast<int64_t>(ll_exchange_region_bytes(c)), c.region_budget_bytes + (int64_t{1} << 20));
  c.max_tokens = 5;
  EXPECT_EQ(ll_exchange_shape(c).max_tokens, 5);
  c.max_tokens = 100000;
  EXPECT_THROW(ll_exchange_shape(c), Error);
}

}  // namespace
}  // namespace bg::moe
