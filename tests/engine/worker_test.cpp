// The worker end to end on the tiny random Kimi-K3, in-process over a ZeroMQ inproc ROUTER playing the frontend:
// loading -> ready, 16 concurrent greedy requests equal to the same requests one at a time, cancellation freeing
// blocks and slots (seen in status), seeded sampling independent of the batch, rejections, load failure, shutdown
// and exit when the parent process dies.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <thread>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "engine/worker.h"
#include "model/random_checkpoint.h"
#include "temp_dir.h"

namespace bg::engine {
namespace {

using bg::testing::TempDir;
using Clock = std::chrono::steady_clock;

struct Result {
  std::vector<int32_t> tokens;
  std::string finish_reason;
  std::string error;
  int32_t error_code = 0;
};

// The frontend's side: binds a ROUTER, runs run_worker on a thread, sends commands and gathers events.
class FakeFrontend {
 public:
  explicit FakeFrontend(WorkerOptions o) : router_(ctx_, zmq::socket_type::router) {
    static int counter = 0;
    o.endpoint = fmt::format("inproc://worker-test-{}", counter++);
    o.context = &ctx_;
    router_.bind(o.endpoint);
    thread_ = std::thread([this, o] { exit_code_ = run_worker(o); });
  }
  ~FakeFrontend() {
    if (thread_.joinable()) {
      send("shutdown", nlohmann::json::object());
      thread_.join();
    }
  }

  void send(const std::string& type, const nlohmann::json& body) {
    router_.send(zmq::buffer(std::string("rank-0")), zmq::send_flags::sndmore);
    router_.send(zmq::buffer(proto::encode(type, body)), zmq::send_flags::none);
  }
  void generate(const proto::GenerateRequest& g) { send("generate", nlohmann::json(g)); }

  // Next message within `timeout_ms`; tokens events are folded into results, statuses into `status`.
  std::optional<proto::Message> recv(int64_t timeout_ms = 20000) {
    zmq::pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms)) == 0) return std::nullopt;
    std::vector<zmq::message_t> parts;
    EXPECT_TRUE(zmq::recv_multipart(router_, std::back_inserter(parts)));
    EXPECT_EQ(parts.size(), 2u);
    EXPECT_EQ(parts[0].to_string(), "rank-0");
    proto::Message m = proto::decode(std::span<const std::byte>(
        static_cast<const std::byte*>(parts[1].data()), parts[1].size()));
    if (m.type == "status") status = proto::body_as<proto::WorkerStatus>(m);
    if (m.type == "tokens") {
      auto ev = proto::body_as<proto::TokenEvent>(m);
      Result& r = results[ev.id];
      EXPECT_TRUE(r.finish_reason.empty()) << ev.id << ": event after the final one";
      r.tokens.insert(r.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      r.finish_reason = ev.finish_reason;
      r.error = ev.error;
      r.error_code = ev.error_code;
    }
    return m;
  }
  proto::WorkerStatus wait_phase(const std::string& phase) {
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline) {
      auto m = recv();
      if (m && m->type == "status" && status.phase == phase) return status;
    }
    ADD_FAILURE() << "no status with phase " << phase;
    return status;
  }
  void wait_finished(const std::vector<std::string>& ids) {
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    auto done = [&] {
      for (const auto& id : ids) {
        if (results[id].finish_reason.empty()) return false;
      }
      return true;
    };
    while (!done() && Clock::now() < deadline) recv();
    ASSERT_TRUE(done()) << "requests did not finish in time";
  }
  // The next status after a status_request (anything sent before it reflects no older state than the events
  // already received, since the worker frees memory before it sends a request's final event).
  proto::WorkerStatus fresh_status() {
    send("status_request", nlohmann::json::object());
    while (auto m = recv()) {
      if (m->type == "status") break;
    }
    return status;
  }
  int join() {
    thread_.join();
    return exit_code_;
  }

  proto::WorkerStatus status;
  std::map<std::string, Result> results;

 private:
  zmq::context_t ctx_;
  zmq::socket_t router_;
  std::thread thread_;
  int exit_code_ = -1;
};

class WorkerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    RandomCheckpointSpec spec;
    spec.arch = "kimi_k3";
    spec.preset = "tiny";
    spec.out_dir = dir_->path() / "model";
    write_random_checkpoint(spec);
  }
  static void TearDownTestSuite() { delete dir_; }

  static WorkerOptions options() {
    WorkerOptions o;
    o.model_dir = dir_->path() / "model";
    o.max_num_seqs = 16;
    o.max_model_len = 256;
    o.kv_cache_memory_bytes = 32 << 20;
    o.idle_poll_ms = 20;
    return o;
  }
  static TempDir* dir_;
};
TempDir* WorkerTest::dir_ = nullptr;

proto::GenerateRequest request(const std::string& id, int64_t n_prompt, int64_t max_tokens, uint32_t salt) {
  proto::GenerateRequest g;
  g.id = id;
  for (int64_t t = 0; t < n_prompt; ++t) g.prompt.push_back(static_cast<int32_t>((salt * 131 + t * 37 + 5) % 1000));
  g.params.temperature = 0.0f;
  g.params.max_tokens = max_tokens;
  g.params.ignore_eos = true;
  return g;
}

TEST_F(WorkerTest, ReportsLoadingThenReady) {
  FakeFrontend f(options());
  EXPECT_EQ(f.wait_phase("loading").rank, 0);
  proto::WorkerStatus s = f.wait_phase("ready");
  EXPECT_EQ(s.arch, "kimi_k3");
  EXPECT_EQ(s.vocab_size, 1024);
  EXPECT_EQ(s.max_model_len, 256);
  EXPECT_EQ(s.max_num_seqs, 16);
  EXPECT_GE(s.state_slots_total, 16);  // the running sequences' slots + the prefix cache's own room for snapshots
  EXPECT_EQ(s.kv_blocks_total, s.kv_blocks_free);
  EXPECT_GT(s.kv_blocks_total, 0);
  EXPECT_EQ(s.eos_token_id, 770);
}

TEST_F(WorkerTest, ConcurrentGreedyRequestsEqualOneAtATime) {
  std::vector<proto::GenerateRequest> reqs;
  std::vector<std::string> ids;
  for (uint32_t i = 0; i < 16; ++i) {
    reqs.push_back(request(fmt::format("r{}", i), 4 + i, 6, i));
    ids.push_back(reqs.back().id);
  }
  FakeFrontend alone(options());
  alone.wait_phase("ready");
  for (const auto& g : reqs) {
    alone.generate(g);
    alone.wait_finished({g.id});
  }
  FakeFrontend batched(options());
  batched.wait_phase("ready");
  for (const auto& g : reqs) batched.generate(g);
  batched.wait_finished(ids);
  for (const auto& id : ids) {
    EXPECT_EQ(batched.results[id].finish_reason, "length") << id;
    EXPECT_EQ(batched.results[id].tokens.size(), 6u) << id;
    EXPECT_EQ(batched.results[id].tokens, alone.results[id].tokens) << id;
  }
  const proto::WorkerStatus a = alone.fresh_status(), b = batched.fresh_status();
  EXPECT_EQ(b.generation_tokens_total, 16 * 6);
  EXPECT_LT(b.steps_total, a.steps_total / 4);  // the batch ran together: ~6 steps instead of 16 x 6
  EXPECT_EQ(b.running, 0);
  EXPECT_EQ(b.kv_blocks_free, b.kv_blocks_total);
}

TEST_F(WorkerTest, CancelMidGenerationFreesBlocksAndSlot) {
  FakeFrontend f(options());
  f.wait_phase("ready");
  f.generate(request("long", 8, 240, 3));
  while (f.results["long"].tokens.empty()) ASSERT_TRUE(f.recv());
  f.send("cancel", nlohmann::json(proto::Cancel{"long"}));
  f.wait_finished({"long"});
  EXPECT_EQ(f.results["long"].finish_reason, "abort");
  EXPECT_LT(f.results["long"].tokens.size(), 240u);
  const proto::WorkerStatus s = f.fresh_status();
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.kv_blocks_free, s.kv_blocks_total);
  EXPECT_EQ(s.state_slots_free, s.state_slots_total);
}

TEST_F(WorkerTest, SeededSamplingIsReproducibleAloneOrInABatch) {
  auto sampled = [](const std::string& id, uint64_t seed) {
    proto::GenerateRequest g = request(id, 6, 8, 11);
    g.params.temperature = 1.0f;
    g.params.top_p = 0.95f;
    g.params.seed = seed;
    return g;
  };
  FakeFrontend f(options());
  f.wait_phase("ready");
  f.generate(sampled("alone", 42));
  f.wait_finished({"alone"});
  f.generate(request("other1", 9, 8, 1));
  f.generate(sampled("batched", 42));
  f.generate(request("other2", 5, 8, 2));
  f.generate(sampled("seed43", 43));
  f.wait_finished({"other1", "batched", "other2", "seed43"});
  EXPECT_EQ(f.results["batched"].tokens, f.results["alone"].tokens);
  EXPECT_NE(f.results["seed43"].tokens, f.results["alone"].tokens);
}

TEST_F(WorkerTest, RejectsBadRequestsAndKeepsServing) {
  FakeFrontend f(options());
  f.wait_phase("ready");
  f.generate(request("too-long", 300, 4, 0));
  proto::GenerateRequest bad_id = request("bad-id", 4, 4, 0);
  bad_id.prompt[1] = 5000;
  f.generate(bad_id);
  f.send("generate", nlohmann::json{{"id", "malformed"}, {"prompt", "not a list"}});
  f.generate(request("ok", 4, 3, 0));
  f.wait_finished({"too-long", "bad-id", "malformed", "ok"});
  EXPECT_EQ(f.results["too-long"].error_code, 400);
  EXPECT_NE(f.results["too-long"].error.find("maximum context length is 256"), std::string::npos);
  EXPECT_EQ(f.results["bad-id"].error_code, 400);
  EXPECT_EQ(f.results["malformed"].error_code, 400);
  EXPECT_EQ(f.results["ok"].finish_reason, "length");
}

TEST_F(WorkerTest, LoadFailureIsReportedAndExitsNonZero) {
  WorkerOptions o = options();
  o.model_dir = dir_->path() / "missing";
  FakeFrontend f(o);
  f.wait_phase("loading");
  proto::WorkerStatus s = f.wait_phase("failed");
  EXPECT_NE(s.error.find("does not exist"), std::string::npos) << s.error;
  EXPECT_EQ(f.join(), 1);
}

TEST_F(WorkerTest, ShutdownExitsCleanly) {
  FakeFrontend f(options());
  f.wait_phase("ready");
  f.send("shutdown", nlohmann::json::object());
  EXPECT_EQ(f.join(), 0);
}

TEST_F(WorkerTest, ExitsWhenTheParentProcessDies) {
  const pid_t parent = fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {
    for (;;) pause();
  }
  WorkerOptions o = options();
  o.parent_pid = parent;
  FakeFrontend f(o);
  f.wait_phase("ready");
  kill(parent, SIGKILL);
  waitpid(parent, nullptr, 0);
  EXPECT_EQ(f.join(), 0);
}

}  // namespace
}  // namespace bg::engine
