// The engine with the state manager over the fake model: prefix caching gives the same tokens as no caching and
// reports the cached prompt tokens; preemption moves a sequence to the host tier and back instead of recomputing
// it; cancelling an offloaded request frees its host pages; the status carries the cache and tier counters.
#include <gtest/gtest.h>

#include <map>
#include <numeric>

#include "engine/engine.h"
#include "sched/fake_model.h"

namespace bg::engine {
namespace {

using bg::testing::FakeModel;
using bg::testing::FakeModelOptions;

struct Final {
  std::vector<int32_t> tokens;
  std::string finish_reason;
  int64_t cached_tokens = -1;
};

class Runner {
 public:
  Runner(const FakeModelOptions& mo, sched::SchedulerConfig sc = {4, 256, 64, 64, 0.0})
      : engine_(std::make_unique<FakeModel>(mo), mo.state_plan(), sc) {}

  void submit(const std::string& id, std::vector<int32_t> prompt, int64_t max_tokens) {
    proto::GenerateRequest g;
    g.id = id;
    g.prompt = std::move(prompt);
    g.params.max_tokens = max_tokens;
    g.params.temperature = 0.0f;
    g.params.ignore_eos = true;
    engine_.submit(std::move(g));
  }
  void run_to_end() {
    for (int i = 0; i < 5000 && engine_.has_work(); ++i) {
      engine_.step();
      collect();
    }
    collect();
    ASSERT_FALSE(engine_.has_work());
  }
  void step() {
    engine_.step();
    collect();
  }
  Engine& engine() { return engine_; }
  std::map<std::string, Final> results;

 private:
  void collect() {
    for (const proto::TokenEvent& ev : engine_.take_events()) {
      Final& f = results[ev.id];
      f.tokens.insert(f.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      if (!ev.finish_reason.empty()) {
        f.finish_reason = ev.finish_reason;
        f.cached_tokens = ev.cached_tokens;
      }
    }
  }
  Engine engine_;
};

std::vector<int32_t> ids(int n, int32_t first) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = (first + 5 * i) % 60;
  return v;
}

// Three turns of four conversations sharing an 18-token system prompt (ends mid-block and between snapshots).
std::map<std::string, Final> conversations(const FakeModelOptions& mo) {
  Runner r(mo);
  const std::vector<int32_t> system = ids(18, 3);
  std::map<int, std::vector<int32_t>> history;
  for (int turn = 0; turn < 3; ++turn) {
    for (int c = 0; c < 4; ++c) {
      std::vector<int32_t>& h = history[c];
      if (h.empty()) h = system;
      for (int32_t t : ids(3 + c, 10 * turn + c)) h.push_back(t);
      r.submit(fmt::format("c{}t{}", c, turn), h, 5);
    }
    r.run_to_end();
    for (int c = 0; c < 4; ++c) {
      const Final& f = r.results[fmt::format("c{}t{}", c, turn)];
      history[c].insert(history[c].end(), f.tokens.begin(), f.tokens.end());
    }
  }
  proto::WorkerStatus st;
  r.engine().fill_status(st);
  r.results["status"].cached_tokens = st.prefix_cache_hit_tokens_total;
  r.results["status"].tokens = {static_cast<int32_t>(st.prefix_cache_lookups_total),
                                static_cast<int32_t>(st.prefix_cache_hits_total)};
  return r.results;
}

// Returns how many requests hit the cache. exact: no request is preempted and recomputed, so every request is looked
// up once and /metrics' tokens saved equal the sum of usage.cached_tokens; under memory pressure a recomputed request
// is looked up (and may reuse the cache) again, which /metrics counts and its final usage does not.
int64_t expect_cache_transparent(FakeModelOptions mo, bool exact = true) {
  mo.prefix_cache = false;
  auto off = conversations(mo);
  mo.prefix_cache = true;
  auto on = conversations(mo);
  int64_t cached = 0;
  for (const auto& [id, f] : off) {
    if (id == "status") continue;
    EXPECT_EQ(on[id].tokens, f.tokens) << id;
    EXPECT_EQ(on[id].finish_reason, "length") << id;
    EXPECT_EQ(f.cached_tokens, 0) << id;
    cached += on[id].cached_tokens;
  }
  EXPECT_GT(cached, 0);
  if (exact) {
    EXPECT_EQ(on["status"].cached_tokens, cached);  // /metrics' tokens saved = the sum over usage.cached_tokens
    EXPECT_EQ(on["status"].tokens[0], 12);          // every request looked up
  } else {
    EXPECT_GE(on["status"].cached_tokens, cached);
    EXPECT_GE(on["status"].tokens[0], 12);
  }
  EXPECT_EQ(off["status"].cached_tokens, 0);
  return on["status"].tokens[1];
}

TEST(EngineState, PrefixCacheGivesTheSameTokensWithKdaSnapshots) {
  EXPECT_GE(expect_cache_transparent(FakeModelOptions{.n_blocks = 128, .n_slots = 16, .snapshot_interval = 8}), 8);
}

TEST(EngineState, PrefixCacheGivesTheSameTokensWithoutState) {
  EXPECT_GE(expect_cache_transparent(FakeModelOptions{.n_blocks = 128, .with_state = false}), 8);
}

TEST(EngineState, PrefixCacheUnderMemoryPressureStillGivesTheSameTokens) {
  // Few blocks and slots: cache entries are evicted (and, with the host tier, offloaded) all the time.
  const int64_t gpu_only = expect_cache_transparent(FakeModelOptions{.n_blocks = 40, .n_slots = 5,
                                                                      .snapshot_interval = 8}, /*exact=*/false);
  FakeModelOptions mo{.n_blocks = 40, .n_slots = 5, .snapshot_interval = 8};
  mo.host_bytes = 128 * 32;
  const int64_t with_host = expect_cache_transparent(mo, /*exact=*/false);
  EXPECT_GE(gpu_only, 1);
  EXPECT_GT(with_host, gpu_only);  // the host tier keeps what the GPU tier had to give up
  std::printf("[engine state] requests hitting the cache under pressure: %ld GPU only, %ld with the host tier\n",
              static_cast<long>(gpu_only), static_cast<long>(with_host));
}

TEST(EngineState, PreemptionOffloadsToTheHostTierInsteadOfRecomputing) {
  auto run = [](const FakeModelOptions& mo, sched::SchedulerConfig sc) {
    auto r = std::make_unique<Runner>(mo, sc);
    r->submit("a", ids(7, 1), 12);
    r->submit("b", ids(7, 20), 12);
    r->run_to_end();
    return r;
  };
  auto roomy_runner = run(FakeModelOptions{}, {2, 64, 64, 64, 0.0});
  FakeModelOptions tight{.block_tokens = 4, .n_blocks = 6};
  tight.host_bytes = 32 * 32;
  auto tight_runner = run(tight, {2, 24, 64, 64, 0.0});
  Runner& roomy = *roomy_runner;
  Runner& r = *tight_runner;
  EXPECT_GE(r.engine().scheduler().preemptions_total(), 1);
  EXPECT_EQ(r.engine().scheduler().recomputes_total(), 0);
  proto::WorkerStatus st;
  r.engine().fill_status(st);
  EXPECT_GE(st.offloads_total, 1);
  EXPECT_EQ(st.restores_total, st.offloads_total);
  EXPECT_EQ(st.seqs_offloaded, 0);
  EXPECT_EQ(st.host_kv_bytes + st.host_state_bytes, 0);
  EXPECT_EQ(st.host_bytes_total, 32 * 32);
  for (const char* id : {"a", "b"}) EXPECT_EQ(r.results[id].tokens, roomy.results[id].tokens) << id;
  EXPECT_GT(r.engine().stats().computed_tokens_total, 0);
  EXPECT_EQ(r.engine().stats().computed_tokens_total, roomy.engine().stats().computed_tokens_total);  // no recompute
}

TEST(EngineState, CancellingAnOffloadedRequestFreesItsHostPages) {
  FakeModelOptions mo{.block_tokens = 4, .n_blocks = 6};
  mo.host_bytes = 32 * 32;
  Runner r(mo, {2, 24, 64, 64, 0.0});
  r.submit("a", ids(7, 1), 30);
  r.submit("b", ids(7, 20), 30);
  for (int i = 0; i < 40 && r.engine().state().usage().seqs_offloaded == 0; ++i) r.engine().step();
  ASSERT_EQ(r.engine().state().usage().seqs_offloaded, 1);
  const std::string parked = r.engine().scheduler().find("b")->offloaded() ? "b" : "a";
  r.engine().cancel(parked);
  const kv::StateUsage u = r.engine().state().usage();
  EXPECT_EQ(u.seqs_offloaded, 0);
  EXPECT_EQ(u.host_kv_bytes + u.host_state_bytes, 0);
  r.run_to_end();
  EXPECT_EQ(r.results[parked].finish_reason, "abort");
}

TEST(EngineState, SwapQuantumRunsMoreRequestsAtOnceThanTheGpuHolds) {
  // Two state slots, eight requests: without time slicing at most two are in flight; with a 3-step quantum and a
  // host tier all eight start within a few steps and take turns, and every one gives the tokens it gives alone.
  auto run = [](int64_t host_bytes, int64_t quantum, int64_t* most_in_flight) {
    FakeModelOptions mo{.n_blocks = 64, .n_slots = 2};
    mo.host_bytes = host_bytes;
    auto r = std::make_unique<Runner>(mo, sched::SchedulerConfig{2, 256, 64, 64, 0.0, quantum});
    for (int i = 0; i < 8; ++i) r->submit(fmt::format("r{}", i), ids(5 + i, 3 * i), 20);
    *most_in_flight = 0;
    for (int i = 0; i < 5000 && r->engine().has_work(); ++i) {
      r->step();
      const kv::StateUsage u = r->engine().state().usage();
      *most_in_flight = std::max(*most_in_flight, r->engine().scheduler().n_running() + u.seqs_offloaded);
    }
    r->run_to_end();
    return r;
  };
  int64_t plain_in_flight = 0, sliced_in_flight = 0;
  auto plain = run(0, 0, &plain_in_flight);
  auto sliced = run(int64_t{1} << 20, 3, &sliced_in_flight);
  EXPECT_EQ(plain_in_flight, 2);
  EXPECT_EQ(sliced_in_flight, 8);
  EXPECT_GE(sliced->engine().scheduler().rotations_total(), 6);
  for (int i = 0; i < 8; ++i) {
    const std::string id = fmt::format("r{}", i);
    EXPECT_EQ(sliced->results[id].tokens, plain->results[id].tokens) << id;
    EXPECT_EQ(sliced->results[id].tokens.size(), 20u) << id;
  }
  FakeModelOptions no_host;
  EXPECT_THROW(Engine(std::make_unique<FakeModel>(no_host), no_host.state_plan(),
                      sched::SchedulerConfig{2, 256, 64, 64, 0.0, 3}), Error);
}

}  // namespace
}  // namespace bg::engine
