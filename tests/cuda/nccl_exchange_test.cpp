// The nccl expert exchange between CUDA ranks (one thread per GPU, each with its own NCCL communicator) against the
// loopback on the same data: the test plays the experts (y = x), so the combine is sum_k w x[t] accumulated in k
// order, and the exchange must give the loopback's bits exactly (uneven token counts, a rank with none). Also the
// NCCL Comm collectives. Skipped (loudly) without at least two GPUs: NCCL does not put two ranks on one device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "cuda/cuda_testing.h"
#include "dist/cuda/nccl_comm.h"
#include "moe/cuda_exchange.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"
#include "cuda/exchange_testing.h"

namespace bg::moe {
namespace {

using namespace exchange_testing;  // NOLINT: the shared fixtures of the exchange tests

int gpus_for_test() {
  const int n = cuda::device_count();
  return n >= 4 ? 4 : n;
}

#define BG_REQUIRE_GPUS(n)                                                                                  \
  do {                                                                                                      \
    BG_REQUIRE_GPU();                                                                                       \
    if (cuda::device_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs: multi-GPU test did not run"; \
  } while (0)

// Runs body(ctx) on `world` threads, one rank (and GPU) each; failures inside, exceptions included, are gtest
// failures (an exception escaping a rank's thread used to abort the whole binary; the other ranks' waits time out).
template <typename Fn>
void run_gpu_ranks(int32_t world, Fn body) {
  const dist::NcclUniqueIdBytes id = dist::nccl_unique_id();
  dist::ParallelFlags flags;
  flags.ep = world;
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(flags);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto ctx = dist::make_nccl_rank_context(id, dist::RankPlace{layout, r}, 120.0);
        body(*ctx);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
}

TEST(NcclExchange, EqualsTheLoopbackBitForBitOnEveryRank) {
  BG_REQUIRE_GPUS(2);
  const int32_t world = gpus_for_test();
  run_gpu_ranks(world, [&](dist::RankContext& ctx) {
    auto be = make_cuda_backend();
    Handles h(*be);
    const int32_t me = ctx.rank();
    const ExpertPlacement place = ExpertPlacement::contiguous(kExperts, world, me);
    const ExpertPlacement one = ExpertPlacement::contiguous(kExperts, 1, 0);
    const ExpertTable table(*be, place, h.of(place)), table_one(*be, one, h.all);
    auto ex = make_nccl_exchange(*be, CudaExchangeConfig{&ctx, place, kTopK, kHidden, 0});
    auto loop = make_loopback_exchange();
    std::mt19937 rng(static_cast<uint32_t>(1234 + me));
    for (int round = 0; round < 3; ++round) {
      const int64_t n = me == 1 && round == 0 ? 0 : 5 + 17 * me + round;  // uneven, one rank empty once
      std::vector<int32_t> ids;
      std::vector<float> w, x = testing::random_floats(static_cast<size_t>(n * kHidden), 1.0f, rng());
      std::vector<float> init = testing::random_floats(x.size(), 0.5f, rng());
      for (int64_t t = 0; t < n; ++t) {
        std::vector<int32_t> e(kExperts);
        std::iota(e.begin(), e.end(), 0);
        std::shuffle(e.begin(), e.end(), rng);
        for (int64_t k = 0; k < kTopK; ++k) {
          ids.push_back(e[static_cast<size_t>(k)]);
          w.push_back(0.1f + 0.9f * std::uniform_real_distribution<float>()(rng));
        }
      }
      const std::vector<float> got = exchange_once(*be, *ex, table, ids, w, x, init);
      const std::vector<float> ref = exchange_once(*be, *loop, table_one, ids, w, x, init);
      ASSERT_EQ(got.size(), ref.size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i])) << "rank " << me << " value " << i;
        ASSERT_EQ(std::memcmp(&got[i], &ref[i], 4), 0) << "rank " << me << " round " << round << " value " << i
                                                       << ": " << got[i] << " vs " << ref[i];
      }
    }
  });
}

TEST(NcclComm, CollectivesGiveEveryRankTheSameAnswer) {
  BG_REQUIRE_GPUS(2);
  const int32_t world = gpus_for_test();
  run_gpu_ranks(world, [&](dist::RankContext& ctx) {
    auto be = make_cuda_backend();
    const int32_t me = ctx.rank();
    std::vector<float> v(1000, static_cast<float>(me + 1));
    Tensor t = be->upload_f32(v, {1000}, DType::kF32);
    ctx.world->all_reduce_sum(*be, t);
    std::vector<float> got(1000);
    be->download_f32(t, got.data());
    EXPECT_EQ(got[999], static_cast<float>(world * (world + 1) / 2));
    std::vector<int64_t> m{me, -me};
    ctx.world->all_reduce_max(m);
    EXPECT_EQ(m[0], world - 1);
    EXPECT_EQ(m[1], 0);
    std::vector<std::byte> b(static_cast<size_t>(me + 3), std::byte{static_cast<unsigned char>(me)});
    const auto all = ctx.world->all_gather_bytes(b);
    ASSERT_EQ(static_cast<int32_t>(all.size()), world);
    for (int32_t r = 0; r < world; ++r) EXPECT_EQ(all[static_cast<size_t>(r)].size(), static_cast<size_t>(r + 3));
    std::vector<std::byte> msg = me == 0 ? std::vector<std::byte>{std::byte{7}, std::byte{9}} : std::vector<std::byte>{};
    ctx.world->broadcast(msg, 0);
    ASSERT_EQ(msg.size(), 2u);
    EXPECT_EQ(msg[1], std::byte{9});
    ctx.world->barrier();
  });
}

}  // namespace
}  // namespace bg::moe
