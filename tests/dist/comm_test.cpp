// Parallel layouts from flags, and the shared-memory collectives between ranks (threads with their own mappings):
// every member gets the same bits, chunking past the slot size, host values, and a dead or failed peer turning into
// RankFailure instead of a hang.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <numeric>
#include <random>

#include "backend/backend.h"
#include "core/error.h"
#include "dist/parallel_layout.h"
#include "dist/rank_setup.h"
#include "dist/rank_testing.h"
#include "dist/shm_comm.h"

namespace bg::dist {
namespace {

ParallelLayout layout_of(std::optional<int32_t> tp, std::optional<int32_t> dp, std::optional<int32_t> ep) {
  ParallelFlags f;
  f.tp = tp;
  f.dp = dp;
  f.ep = ep;
  return ParallelLayout::from_flags(f);
}

TEST(ParallelLayout, FlagsDeriveTheMissingSizes) {
  EXPECT_EQ(layout_of({}, {}, {}).world(), 1);
  const ParallelLayout ep4 = layout_of({}, {}, 4);  // DP attention: every rank its own group
  EXPECT_EQ(ep4.world(), 4);
  EXPECT_EQ(ep4.dp(), 4);
  EXPECT_EQ(ep4.tp(), 1);
  const ParallelLayout tp2 = layout_of(2, {}, {});
  EXPECT_EQ(tp2.world(), 2);
  EXPECT_EQ(tp2.dp(), 1);
  const ParallelLayout mixed = layout_of({}, 2, 4);  // --dp 2 --ep 4: two groups of TP 2
  EXPECT_EQ(mixed.tp(), 2);
  EXPECT_EQ(mixed.dp(), 2);
  EXPECT_EQ(mixed.dp_group(3), 1);
  EXPECT_EQ(mixed.tp_rank(3), 1);
  EXPECT_TRUE(mixed.is_leader(2));
  EXPECT_FALSE(mixed.is_leader(3));
  EXPECT_EQ(layout_of(2, 2, 4).describe(), "dp=2 tp=2 ep=4 (4 ranks)");
  EXPECT_THROW(layout_of(2, 2, 8), Error);   // 2 x 2 != 8
  EXPECT_THROW(layout_of(3, {}, 4), Error);  // tp does not divide ep
  EXPECT_THROW(layout_of(0, {}, {}), Error);
  ParallelFlags nodes;
  nodes.ep = 4;
  nodes.nnodes = 3;
  EXPECT_THROW(ParallelLayout::from_flags(nodes), Error);  // 4 ranks on 3 nodes
  nodes.nnodes = 2;
  nodes.node_rank = 1;
  EXPECT_EQ(ParallelLayout::from_flags(nodes).first_rank_of(1), 2);
  EXPECT_EQ(parse_host_port("10.0.0.1:5000", "--dist-init-addr").port, 5000);
  EXPECT_THROW(parse_host_port("10.0.0.1", "--dist-init-addr"), Error);
  EXPECT_THROW(parse_host_port("h:99999", "--dist-init-addr"), Error);
}

TEST(ShmComm, AllReduceGivesEveryMemberTheSameSumAcrossChunks) {
  auto be = make_backend("cpu");
  const ParallelLayout l = layout_of(2, 2, 4);
  std::vector<std::vector<float>> results(4);
  testing::run_ranks(l, [&](RankContext& ctx) {
    const int32_t r = ctx.rank();
    // 10000 floats = 40 KB: three rounds of the 16 KB test slot.
    std::vector<float> v(10000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.1f * static_cast<float>(r + 1) + 1e-3f * static_cast<float>(i);
    Tensor t = be->upload_f32(v, {100, 100}, DType::kF32);
    ctx.world->all_reduce_sum(*be, t);
    results[static_cast<size_t>(r)].assign(t.as<float>(), t.as<float>() + 10000);
    // The TP group (2 members) sums only its own.
    Tensor g = be->upload_f32(std::vector<float>{static_cast<float>(r)}, {1}, DType::kF32);
    ctx.tp->all_reduce_sum(*be, g);
    EXPECT_EQ(g.as<float>()[0], static_cast<float>(ctx.place.dp_group() * 4 + 1));  // 0+1 or 2+3
  });
  for (size_t i = 0; i < 10000; ++i) {
    float want = 0.0f;
    for (int r = 0; r < 4; ++r) want += 0.1f * static_cast<float>(r + 1) + 1e-3f * static_cast<float>(i);
    ASSERT_EQ(results[0][i], want) << i;  // member order: the reference sums in the same order
    for (int r = 1; r < 4; ++r) ASSERT_EQ(std::memcmp(&results[r][i], &results[0][i], 4), 0) << "rank " << r;
  }
}

TEST(ShmComm, GatherScatterBroadcastAndHostValues) {
  auto be = make_backend("cpu");
  testing::run_ranks(layout_of({}, {}, 3), [&](RankContext& ctx) {
    const int32_t r = ctx.rank();
    std::vector<float> mine(3000, static_cast<float>(r));
    Tensor in = be->upload_f32(mine, {1000, 3}, DType::kF32), out = be->alloc({3000, 3}, DType::kF32);
    ctx.world->all_gather(*be, in, out);
    for (int64_t i = 0; i < 9000; ++i) ASSERT_EQ(out.as<float>()[i], static_cast<float>(i / 3000)) << i;
    // reduce_scatter: member m gets block m summed over the members (block values = m * 10 + rank).
    std::vector<float> blocks(3 * 2000);
    for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<float>(i / 2000 * 10 + r);
    Tensor rs_in = be->upload_f32(blocks, {3 * 2000}, DType::kF32), rs_out = be->alloc({2000}, DType::kF32);
    ctx.world->reduce_scatter_sum(*be, rs_in, rs_out);
    for (int64_t i = 0; i < 2000; ++i) ASSERT_EQ(rs_out.as<float>()[i], static_cast<float>(3 * r * 10 + 3));
    int64_t v[2] = {r, -r};
    ctx.world->all_reduce_max(v);
    EXPECT_EQ(v[0], 2);
    EXPECT_EQ(v[1], 0);
    std::vector<std::byte> msg;
    if (r == 1) msg.assign(50000, std::byte{7});  // bigger than a slot
    ctx.world->broadcast(msg, 1);
    EXPECT_EQ(msg.size(), 50000u);
    EXPECT_EQ(msg.back(), std::byte{7});
    std::vector<std::byte> tag(static_cast<size_t>(r * 20000), static_cast<std::byte>(r));
    const auto all = ctx.world->all_gather_bytes(tag);
    ASSERT_EQ(all.size(), 3u);
    for (size_t m = 0; m < 3; ++m) {
      EXPECT_EQ(all[m].size(), m * 20000);
      if (!all[m].empty()) {
        EXPECT_EQ(all[m].front(), static_cast<std::byte>(m));
      }
    }
    ctx.world->barrier();
  });
}

TEST(ShmComm, AFailedRankStopsTheOthersWaiting) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(testing::run_ranks(layout_of({}, {}, 3), [&](RankContext& ctx) {
                 if (ctx.rank() == 2) throw Error("rank 2 fails before the collective");
                 ctx.world->barrier();  // ranks 0 and 1 would wait forever without the failed word
               }),
               Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// A rank process that dies (kill -9) is noticed by the others within about a second.
TEST(ShmComm, ADeadRankProcessIsNoticed) {
  const ParallelLayout l = layout_of({}, {}, 2);
  const std::string name = unique_shm_name("test-dead");
  const ShmCommOptions opt{.slot_bytes = size_t{16} << 10, .timeout_s = 60.0};
  auto zero = ShmRankSet::create(name, {l, 0}, opt);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto one = ShmRankSet::open(name, {l, 1}, opt);
    one->attach_and_wait();
    pause();  // until killed
    _exit(0);
  }
  zero->attach_and_wait();
  kill(child, SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  auto comm = zero->world_comm();
  try {
    comm->barrier();
    ADD_FAILURE() << "the barrier with a dead rank returned";
  } catch (const RankFailure& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  waitpid(child, nullptr, 0);
}

// A rank that cannot run is refused before it joins anything (no silent fallback): an unknown exchange, and CUDA
// ranks (the ll exchange's included) without a visible GPU. The GPU is hidden for this process's CUDA runtime, which
// no test of this binary has started.
TEST(RankSetup, ARankThatCannotRunIsRefusedBeforeJoining) {
  RankSetup s;
  ParallelFlags flags;
  flags.ep = 2;
  s.place.layout = ParallelLayout::from_flags(flags);
  s.device = "cuda";
  s.rendezvous = "ipc:///nonexistent/never-joined.sock";
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string saved = visible != nullptr ? visible : "";
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  for (const char* exchange : {"ll", "nccl"}) {
    s.exchange = exchange;
    const auto start = std::chrono::steady_clock::now();
    try {
      start_rank(s);
      ADD_FAILURE() << "start_rank joined with --device cuda and no GPU (" << exchange << ")";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("no CUDA device is visible") != std::string::npos ||
                  what.find("needs a batchgen built with CUDA") != std::string::npos) << what;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << exchange;
  }
  if (visible != nullptr) {
    setenv("CUDA_VISIBLE_DEVICES", saved.c_str(), 1);
  } else {
    unsetenv("CUDA_VISIBLE_DEVICES");
  }
  s.device = "cpu";
  s.exchange = "mpi";
  EXPECT_THROW(start_rank(s), Error);
}

}  // namespace
}  // namespace bg::dist
