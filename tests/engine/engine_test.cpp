// The engine over a fake model: events, batching independence (greedy and seeded), preemption + recompute giving the
// same tokens, a failing request isolated from its batch, rejections, cancellation and status.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <numeric>

#include "engine/engine.h"
#include "sched/fake_model.h"

namespace bg::engine {
namespace {

using bg::testing::FakeModel;
using bg::testing::FakeModelOptions;

struct Result {
  std::vector<int32_t> tokens;
  std::string finish_reason;
  std::string error;
  int32_t error_code = 0;
  int64_t n_events = 0;
  std::vector<proto::TokenLogprob> logprobs;
};

proto::GenerateRequest request(const std::string& id, int32_t first, int64_t n_prompt, int64_t max_tokens,
                               float temperature = 0.0f, uint64_t seed = 1) {
  proto::GenerateRequest g;
  g.id = id;
  g.prompt.resize(static_cast<size_t>(n_prompt));
  std::iota(g.prompt.begin(), g.prompt.end(), first);
  g.params.max_tokens = max_tokens;
  g.params.temperature = temperature;
  g.params.seed = seed;
  g.params.ignore_eos = true;
  return g;
}

struct Harness {
  explicit Harness(const FakeModelOptions& mo = {}, sched::SchedulerConfig sc = {4, 256, 64, 64, 0.0})
      : model(new FakeModel(mo)), engine(std::unique_ptr<Model>(model), mo.state_plan(), sc) {}

  void collect() {
    for (proto::TokenEvent& ev : engine.take_events()) {
      Result& r = results[ev.id];
      EXPECT_TRUE(r.finish_reason.empty()) << ev.id << ": event after the final one";
      r.tokens.insert(r.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      r.logprobs.insert(r.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      r.finish_reason = ev.finish_reason;
      r.error = ev.error;
      r.error_code = ev.error_code;
      ++r.n_events;
      if (!ev.finish_reason.empty() && ev.finish_reason != "error" && ev.finish_reason != "abort") {
        EXPECT_EQ(ev.completion_tokens, static_cast<int64_t>(r.tokens.size()));
      }
    }
  }
  void run_to_end(int max_steps = 1000) {
    for (int i = 0; i < max_steps && engine.has_work(); ++i) {
      engine.step();
      collect();
    }
    collect();
    ASSERT_FALSE(engine.has_work());
  }

  FakeModel* model;  // owned by the engine
  Engine engine;
  std::map<std::string, Result> results;
};

std::vector<proto::GenerateRequest> mixed_requests(float temperature) {
  std::vector<proto::GenerateRequest> reqs;
  for (int i = 0; i < 6; ++i) {
    reqs.push_back(request(fmt::format("r{}", i), 3 * i, 2 + 5 * i, 6 + i, temperature, 100 + i));
  }
  return reqs;
}

void expect_batching_independent(float temperature) {
  std::map<std::string, Result> alone;
  for (const auto& g : mixed_requests(temperature)) {
    Harness h;
    h.engine.submit(g);
    h.run_to_end();
    alone[g.id] = h.results[g.id];
  }
  Harness h;
  for (const auto& g : mixed_requests(temperature)) h.engine.submit(g);
  h.run_to_end();
  for (const auto& [id, r] : alone) {
    EXPECT_EQ(h.results[id].tokens, r.tokens) << id;
    EXPECT_EQ(h.results[id].finish_reason, "length") << id;
  }
  bool batched = false;
  for (const auto& shape : h.model->batches) batched |= shape.size() > 1;
  EXPECT_TRUE(batched);
}

TEST(Engine, GreedyTokensDoNotDependOnTheBatch) { expect_batching_independent(0.0f); }
TEST(Engine, SeededSamplingDoesNotDependOnTheBatch) { expect_batching_independent(1.0f); }

TEST(Engine, PreemptionRecomputesAndKeepsTheTokens) {
  auto reqs = [] {
    return std::vector<proto::GenerateRequest>{request("a", 1, 7, 12, 1.0f, 5), request("b", 20, 7, 12, 1.0f, 6)};
  };
  Harness roomy;
  for (const auto& g : reqs()) roomy.engine.submit(g);
  roomy.run_to_end();
  Harness tight(FakeModelOptions{.block_tokens = 4, .n_blocks = 6}, {2, 24, 64, 64, 0.0});
  for (const auto& g : reqs()) tight.engine.submit(g);
  tight.run_to_end();
  EXPECT_GE(tight.engine.scheduler().preemptions_total(), 1);
  for (const char* id : {"a", "b"}) {
    EXPECT_EQ(tight.results[id].tokens, roomy.results[id].tokens) << id;
    EXPECT_EQ(tight.results[id].tokens.size(), 12u);
  }
  proto::WorkerStatus st;
  tight.engine.fill_status(st);
  EXPECT_EQ(st.preemptions_total, tight.engine.scheduler().preemptions_total());
  EXPECT_EQ(st.kv_blocks_free, 6);
}

TEST(Engine, AFailingRequestDoesNotTakeItsBatchDown) {
  Harness h;
  h.model->poison = {38};
  h.engine.submit(request("good1", 1, 5, 4));
  h.engine.submit(request("bad", 38, 5, 4));  // starts with the poisoned token
  h.engine.submit(request("good2", 10, 5, 4));
  h.run_to_end();
  EXPECT_EQ(h.results["bad"].finish_reason, "error");
  EXPECT_EQ(h.results["bad"].error_code, 500);
  EXPECT_NE(h.results["bad"].error.find("poisoned first token 38"), std::string::npos) << h.results["bad"].error;
  Harness ref;
  ref.engine.submit(request("good1", 1, 5, 4));
  ref.engine.submit(request("good2", 10, 5, 4));
  ref.run_to_end();
  for (const char* id : {"good1", "good2"}) {
    EXPECT_EQ(h.results[id].finish_reason, "length") << id;
    EXPECT_EQ(h.results[id].tokens, ref.results[id].tokens) << id;
  }
  EXPECT_EQ(h.engine.state().usage().kv_blocks_free, h.engine.state().usage().kv_blocks_total);
}

TEST(Engine, RejectionsAreFinalErrorEvents) {
  Harness h;
  auto bad_temp = request("t", 1, 3, 4);
  bad_temp.params.temperature = -1.0f;
  h.engine.submit(bad_temp);
  h.engine.submit(request("range", 60, 10, 4));  // ids up to 69 >= vocab 64
  auto long_prompt = request("long", 1, 1, 4);
  long_prompt.prompt.assign(256, 5);  // max_model_len 256: no room for a completion
  h.engine.submit(long_prompt);
  h.engine.submit(request("dup", 1, 3, 4));
  h.engine.submit(request("dup", 1, 3, 4));
  auto empty = request("empty", 1, 0, 4);
  h.engine.submit(empty);
  h.collect();
  EXPECT_EQ(h.results["t"].error_code, 400);
  EXPECT_NE(h.results["range"].error.find("prompt token id 64 is outside [0, 64)"), std::string::npos);
  EXPECT_EQ(h.results["long"].error_code, 400);
  EXPECT_NE(h.results["long"].error.find("maximum context length"), std::string::npos);
  EXPECT_EQ(h.results["dup"].error_code, 400);
  EXPECT_NE(h.results["dup"].error.find("already in use"), std::string::npos);
  EXPECT_EQ(h.results["empty"].error_code, 400);
  h.results.erase("dup");  // its first copy is still running
  h.run_to_end();
  EXPECT_EQ(h.results["dup"].finish_reason, "length");
}

TEST(Engine, CancelAbortsAndFreesAtOnce) {
  Harness h;
  h.engine.submit(request("a", 1, 30, 50));
  h.engine.submit(request("b", 1, 3, 50));
  h.engine.step();
  h.engine.step();
  h.collect();
  EXPECT_EQ(h.results["a"].tokens.size(), 2u);
  h.engine.cancel("a");
  h.engine.cancel("nope");  // unknown ids are ignored
  h.collect();
  EXPECT_EQ(h.results["a"].finish_reason, "abort");
  proto::WorkerStatus st;
  h.engine.fill_status(st);
  EXPECT_EQ(st.running, 1);
  EXPECT_EQ(st.state_slots_free, st.state_slots_total - 1);
  EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total - 1);  // b: 4 tokens in the cache, one 4-token block
  EXPECT_EQ(st.longest_seq_tokens, 4);                   // b: its prompt and the 2 tokens it generated
  const kv::StateManager& state = h.engine.state();
  const int64_t slot_bytes = st.state_slots_total > 0 ? state.state_pool().slot_bytes() : 0;
  EXPECT_EQ(st.longest_seq_gpu_bytes, state.kv_pool().block_bytes() + slot_bytes);
  h.engine.cancel("b");
  h.engine.fill_status(st);
  EXPECT_EQ(st.longest_seq_tokens, 0);
  EXPECT_EQ(st.longest_seq_gpu_bytes, 0);
  EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
  EXPECT_EQ(st.state_slots_free, st.state_slots_total);
  EXPECT_FALSE(h.engine.has_work());
}

TEST(Engine, StopTokensEosLogprobsAndCounters) {
  Harness probe;
  probe.engine.submit(request("p", 1, 4, 6));
  probe.run_to_end();
  const std::vector<int32_t> free_run = probe.results["p"].tokens;
  ASSERT_EQ(free_run.size(), 6u);
  Harness h;
  auto stop = request("stop", 1, 4, 6);
  stop.params.stop_token_ids = {free_run[2]};
  stop.params.top_logprobs = 2;
  h.engine.submit(stop);
  h.run_to_end();
  const Result& r = h.results["stop"];
  EXPECT_EQ(r.finish_reason, "stop");
  const auto first = std::find(free_run.begin(), free_run.end(), free_run[2]) - free_run.begin();
  EXPECT_EQ(r.tokens.size(), static_cast<size_t>(first + 1));  // the stop token is the last one sent
  ASSERT_EQ(r.logprobs.size(), r.tokens.size());
  EXPECT_EQ(r.logprobs[0].token, r.tokens[0]);
  EXPECT_EQ(r.logprobs[0].top.size(), 2u);
  EXPECT_EQ(r.logprobs[0].top[0].first, r.tokens[0]);  // greedy: the best is the chosen one
  EXPECT_EQ(h.engine.stats().generation_tokens_total, static_cast<int64_t>(r.tokens.size()));
  EXPECT_EQ(h.engine.stats().prompt_tokens_total, 4);
}
}  // namespace
}  // namespace bg::engine

namespace bg::engine {
namespace {

// fail_all ends every request, running and waiting, with the status the caller gives: 503 when the worker or its
// rank set goes away (the client may retry), 500 for a failed step.
TEST(Engine, FailAllEndsEveryRequestWithTheGivenStatus) {
  for (int32_t code : {503, 500}) {
    Harness h({}, {2, 256, 64, 64, 0.0});
    for (int i = 0; i < 3; ++i) h.engine.submit(request(fmt::format("r{}", i), 1 + i, 4, 50));
    h.engine.step();  // two run, one waits
    h.collect();
    h.engine.fail_all("the rank set failed: rank 1 exited", code);
    h.collect();
    EXPECT_FALSE(h.engine.has_work());
    for (int i = 0; i < 3; ++i) {
      const Result& r = h.results[fmt::format("r{}", i)];
      EXPECT_EQ(r.finish_reason, "error");
      EXPECT_EQ(r.error_code, code);
      EXPECT_NE(r.error.find("rank 1 exited"), std::string::npos);
    }
  }
}

TEST(Engine, WarmUpRunsEveryDecodeBucketAndLeavesNoTrace) {
  Harness h;  // max_num_seqs 4, max_model_len 256, 64 tokens per step
  const int64_t steps = h.engine.warm_up();
  EXPECT_GT(steps, 0);
  EXPECT_FALSE(h.engine.has_work());
  EXPECT_TRUE(h.engine.take_events().empty());
  EXPECT_EQ(h.engine.stats().steps_total, 0);
  EXPECT_EQ(h.engine.stats().generation_tokens_total, 0);
  EXPECT_EQ(static_cast<int64_t>(h.model->batches.size()), steps);
  // A whole step of prefill first, then decode steps of 1, 2 and 4 sequences (the graph buckets up to max_num_seqs).
  EXPECT_EQ(std::accumulate(h.model->batches[0].begin(), h.model->batches[0].end(), int64_t{0}), 64);
  std::set<size_t> decode_batches;
  for (const std::vector<int64_t>& b : h.model->batches) {
    if (std::all_of(b.begin(), b.end(), [](int64_t n) { return n == 1; })) decode_batches.insert(b.size());
  }
  EXPECT_EQ(decode_batches, (std::set<size_t>{1, 2, 4}));
  // A request afterwards gets the tokens it gets on a fresh engine.
  Harness fresh;
  for (Harness* e : {&h, &fresh}) {
    e->engine.submit(request("a", 5, 40, 8));
    e->run_to_end();
  }
  EXPECT_EQ(h.results["a"].tokens, fresh.results["a"].tokens);
  EXPECT_EQ(h.results["a"].tokens.size(), 8u);
}

}  // namespace
}  // namespace bg::engine
