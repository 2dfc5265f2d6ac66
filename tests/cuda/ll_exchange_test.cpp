// The ll expert exchange (moe/cuda/ll_exchange.cu) between ranks that share this process and GPU: each rank is a
// thread with its own CUDA backend (and stream); the regions are device allocations every rank addresses directly
// (between processes they come through CUDA IPC, with the same kernels). The test plays the experts (y = x), so
// every rank's combine must give the loopback's arithmetic exactly (out = bf16(out + sum_k w * bf16(x)), fmaf in k
// order over the routed pairs, computed here on the host): over several calls (both buffer parities), uneven token
// counts, a rank without tokens, uneven placements and unrouted pairs (id -1). A bad expert id is reported through the
// backend's error flags without hanging any rank, and the next call works.
//
// Ranks that share one process share its CUDA context, whose streams share a few hardware queues: a rank's flag wait
// queued ahead of a peer's send in the same queue would hold that send back for good. So the ranks enqueue each call
// in phases, with a host barrier between them (every rank's sends before any wait; every return before any reduce).
// Rank processes (LlScoreGpu, serving) have a context each and need none of this. With FP8 dispatch the experts must
// see exactly ll_fp8_roundtrip_cpu of each row (then the same combine bits).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <span>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/dtype.h"
#include "cuda/cuda_testing.h"
#include "cuda/exchange_testing.h"
#include "moe/cuda_exchange.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"
#include "ops/moe_exchange/moe_exchange.h"

namespace bg::moe {
namespace {

using namespace exchange_testing;  // NOLINT: the shared fixtures of the exchange tests

constexpr int64_t kMaxTokens = 48;

struct Placement {
  std::string name;
  int32_t world;
  std::vector<int32_t> owner;  // empty: contiguous ranges
  bool fp8 = false;            // FP8 dispatch rows (--k3-moe-exchange ll-fp8)
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

LlExchangeConfig config_of(const ExpertPlacement& place, bool fp8 = false) {
  LlExchangeConfig c;
  c.fp8_dispatch = fp8;
  c.placement = place;
  c.top_k = kTopK;
  c.hidden = kHidden;
  c.max_tokens = kMaxTokens;
  c.timeout_s = 30.0;  // a broken test fails (the waiting rank traps) instead of hanging
  return c;
}

// Runs body(rank, backend, exchange, table of this rank, table of one rank) on one thread per rank. The ranks start
// their calls together: a rank still setting up (legacy-stream copies of its tables, which wait for every blocking
// stream of this process) must not find a peer's flag wait already spinning on the GPU for it.
using RankBody = std::function<void(int32_t, Backend&, Exchange&, const ExpertTable&, std::barrier<>&)>;

void run_ll_ranks(const Placement& pl, const RankBody& body) {
  const size_t bytes = ll_exchange_region_bytes(config_of(place_of(pl, 0), pl.fp8));
  Regions regions(pl.world, bytes);
  std::barrier ready(pl.world);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < pl.world; ++r) {
    threads.emplace_back([&, r] {
      auto be = make_cuda_backend();
      Handles h(*be);
      const ExpertPlacement place = place_of(pl, r);
      const ExpertTable table(*be, place, h.of(place));
      auto ex = make_ll_exchange(*be, config_of(place, pl.fp8), LlPeerRegions{regions.p, nullptr});
      EXPECT_EQ(ex->max_tokens_per_call(), kMaxTokens);
      be->synchronize();
      ready.arrive_and_wait();
      body(r, *be, *ex, table, ready);
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

// One exchange call with y = x, enqueued in phases between barriers that every rank passes (see the top); returns
// out (initially `init`) after the combine. A device error raises here, after the last barrier.
std::vector<float> exchange_phased(Backend& be, Exchange& ex, const ExpertTable& table, std::barrier<>& sync,
                                   const std::vector<int32_t>& ids, const std::vector<float>& w,
                                   const std::vector<float>& x, const std::vector<float>& init) {
  CallTensors t(be, ids, w, x, init);
  ExpertRows rows;
  sync.arrive_and_wait();
  ex.begin_dispatch(be, table, {&t.ids, &t.weights, &t.x}, rows);  // plan, send
  sync.arrive_and_wait();
  ex.finish_dispatch(be, rows);  // wait, unpack
  be.copy(rows.x, rows.y);
  ex.begin_combine(be, rows, t.out);  // return
  sync.arrive_and_wait();
  ex.finish_combine(be, t.out);  // reduce
  return t.download(be);
}

// "" when got equals want bit for bit, else how many values differ and the first of them.
std::string count_mismatches(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], 4) != 0 && bad++ == 0) first = i;
  }
  if (bad == 0) return "";
  return std::to_string(bad) + " values differ, first " + std::to_string(first) + ": " + std::to_string(got[first]) +
         " vs " + std::to_string(want[first]);
}

// The loopback's combine on the host: out[t] = bf16(init[t] + sum_k w * bf16(x[t])) with fma in k order over the
// routed pairs; `fp8`: the rows the experts see went through ll_fp8_roundtrip_cpu first.
std::vector<float> expected_combine(const std::vector<int32_t>& ids, const std::vector<float>& w,
                                    const std::vector<float>& x, const std::vector<float>& init, bool fp8) {
  const int64_t n = static_cast<int64_t>(x.size()) / kHidden;
  auto bf = [](float v) { return bf16_to_f32(f32_to_bf16(v)); };
  std::vector<float> y(x.size()), out(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = bf(x[i]);
  if (fp8) {
    for (int64_t t = 0; t < n; ++t) ops::ll_fp8_roundtrip_cpu(y.data() + t * kHidden, kHidden);
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < kHidden; ++j) {
      float acc = bf(init[static_cast<size_t>(t * kHidden + j)]);
      for (int64_t k = 0; k < kTopK; ++k) {
        const size_t p = static_cast<size_t>(t * kTopK + k);
        if (ids[p] < 0) continue;
        acc = std::fma(w[p], y[static_cast<size_t>(t * kHidden + j)], acc);
      }
      out[static_cast<size_t>(t * kHidden + j)] = bf(acc);
    }
  }
  return out;
}

class LlExchangeRanks : public ::testing::TestWithParam<Placement> {};

TEST_P(LlExchangeRanks, EqualsTheLoopbackBitForBitOnEveryRank) {
  BG_REQUIRE_GPU();
  const Placement& pl = GetParam();
  run_ll_ranks(pl, [&](int32_t me, Backend& be, Exchange& ex, const ExpertTable& table, std::barrier<>& sync) {
    std::mt19937 rng(static_cast<uint32_t>(4321 + me));
    for (int call = 0; call < 5; ++call) {  // five epochs: both parities, each reused
      const int64_t n = me == 1 && call == 1 ? 0 : std::min<int64_t>(kMaxTokens, 3 + 11 * me + 7 * call);
      std::vector<int32_t> ids;
      std::vector<float> w, x = testing::random_floats(static_cast<size_t>(n * kHidden), 1.0f, rng());
      const std::vector<float> init = testing::random_floats(x.size(), 0.5f, rng());
      route(rng, n, call % 2 == 0 ? 1 : 0, ids, w);
      const std::vector<float> got = exchange_phased(be, ex, table, sync, ids, w, x, init);
      const std::vector<float> ref = expected_combine(ids, w, x, init, pl.fp8);
      // No early return: a rank that left would leave its peers at the next barrier.
      EXPECT_EQ(count_mismatches(got, ref), "") << pl.name << " rank " << me << " call " << call;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Placements, LlExchangeRanks,
    ::testing::Values(Placement{"two_ranks", 2, {}}, Placement{"four_ranks", 4, {}},
                      // rank 0 holds one expert, rank 2 most of them
                      Placement{"uneven_three", 3, {0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 2, 2}},
                      Placement{"two_ranks_fp8", 2, {}, true}, Placement{"four_ranks_fp8", 4, {}, true}),
    [](const auto& param_info) { return param_info.param.name; });

TEST(LlExchange, ABadExpertIdIsReportedAndTheNextCallWorks) {
  BG_REQUIRE_GPU();
  run_ll_ranks(Placement{"two", 2, {}}, [&](int32_t me, Backend& be, Exchange& ex, const ExpertTable& table,
                                             std::barrier<>& sync) {
    std::mt19937 rng(static_cast<uint32_t>(99 + me));
    const int64_t n = 6;
    std::vector<int32_t> ids;
    std::vector<float> w, x = testing::random_floats(static_cast<size_t>(n * kHidden), 1.0f, rng());
    const std::vector<float> init(x.size(), 0.0f);
    route(rng, n, 0, ids, w);
    std::vector<int32_t> bad = ids;
    if (me == 0) bad[5] = static_cast<int32_t>(kExperts);  // out of range: dropped, flagged on rank 0
    try {
      exchange_phased(be, ex, table, sync, bad, w, x, init);
      EXPECT_NE(me, 0) << "a routed id outside the experts was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(me, 0) << e.what();
      EXPECT_NE(std::string(e.what()).find("outside the layer's experts"), std::string::npos) << e.what();
    }
    const std::vector<float> got = exchange_phased(be, ex, table, sync, ids, w, x, init);
    EXPECT_EQ(count_mismatches(got, expected_combine(ids, w, x, init, false)), "") << "rank " << me;
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
  // FP8 dispatch: the same budget carries more tokens (a row is hidden + hidden / 128 * 4 bytes, not 2 * hidden).
  c.max_tokens = 0;
  c.region_budget_bytes = int64_t{256} << 20;
  const int64_t bf16_tokens = ll_exchange_shape(c).max_tokens;
  c.fp8_dispatch = true;
  const ops::LlShape f = ll_exchange_shape(c);
  EXPECT_TRUE(f.fp8);
  EXPECT_GT(f.max_tokens, bf16_tokens);
  c.hidden = 7168 + 64;  // not a multiple of 128
  EXPECT_THROW(ll_exchange_shape(c), Error);
}

}  // namespace
}  // namespace bg::moe
