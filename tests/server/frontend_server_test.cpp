// The HTTP frontend in-process against a scripted fake worker over ZeroMQ: non-streamed and streamed responses,
// tool-call deltas, stop strings and client disconnects cancelling at the worker, rejections, errors, readiness.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <thread>

#include "fake_text_model.h"
#include "fake_worker.h"
#include "server/frontend/http_server.h"
#include "server/frontend/worker_link.h"

namespace bg::frontend {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;
using bg::testing::bytes_to_ids;

std::vector<int32_t> hello_script(const proto::GenerateRequest&) { return bytes_to_ids("Hello world, and more."); }

// Polls `cond` for up to 5 s.
template <typename F>
bool eventually(F cond) {
  for (int i = 0; i < 500; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return cond();
}

class FrontendTest : public ::testing::Test {
 protected:
  void start(bg::testing::FakeWorker::Script script, FrontendConfig cfg = {}, const TextModel* model = nullptr,
             int64_t max_model_len = 64) {
    static std::atomic<int> n{0};
    const std::string endpoint = "inproc://frontend-test-" + std::to_string(n++);
    link_ = std::make_unique<WorkerLink>(ctx_, endpoint, 1);
    link_->start();
    worker_ = std::make_unique<bg::testing::FakeWorker>(ctx_, endpoint, std::move(script), max_model_len);
    if (cfg.served_model_name.empty()) cfg.served_model_name = "tiny";
    server_ = std::make_unique<FrontendServer>(cfg, model != nullptr ? *model : model_, *link_, metrics_);
    port_ = server_->bind("127.0.0.1", 0);
    thread_ = std::thread([this] { server_->listen(); });
    ASSERT_TRUE(eventually([&] { return link_->all_ready(); }));
  }
  void TearDown() override {
    if (server_) server_->stop();
    if (thread_.joinable()) thread_.join();
    worker_.reset();
    if (link_) link_->stop();
  }
  httplib::Result post(const std::string& path, const std::string& body, httplib::Headers headers = {}) {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(10, 0);
    return cli.Post(path.c_str(), headers, body, "application/json");
  }
  httplib::Result get(const std::string& path) {
    httplib::Client cli("127.0.0.1", port_);
    return cli.Get(path.c_str());
  }
  // A streamed request: the "data:" payloads in order (the last one is "[DONE]").
  std::vector<std::string> stream(const std::string& path, const json& body) {
    auto res = post(path, body.dump());
    EXPECT_TRUE(res) << "no response";
    if (!res) return {};
    EXPECT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
    std::vector<std::string> out;
    size_t pos = 0;
    const std::string& b = res->body;
    while ((pos = b.find("data: ", pos)) != std::string::npos) {
      const size_t end = b.find("\n\n", pos);
      out.push_back(b.substr(pos + 6, end - pos - 6));
      pos = end;
    }
    return out;
  }
  static json error_of(const httplib::Result& res) { return json::parse(res->body)["error"]; }

  zmq::context_t ctx_;
  bg::testing::FakeTextModel model_;
  Metrics metrics_;
  std::unique_ptr<WorkerLink> link_;
  std::unique_ptr<bg::testing::FakeWorker> worker_;
  std::unique_ptr<FrontendServer> server_;
  std::thread thread_;
  int port_ = 0;
};

TEST_F(FrontendTest, NonStreamedCompletionAndChat) {
  start(hello_script);
  auto res = post("/v1/completions", R"({"model": "tiny", "prompt": "hi", "max_tokens": 5})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json r = json::parse(res->body);
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["choices"][0]["text"], "Hello");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r["usage"], (json{{"prompt_tokens", 2}, {"completion_tokens", 5}, {"total_tokens", 7},
                              {"prompt_tokens_details", {{"cached_tokens", 0}}}}));

  res = post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                         "logprobs": true, "top_logprobs": 2})");
  ASSERT_EQ(res->status, 200) << res->body;
  r = json::parse(res->body);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["message"], (json{{"role", "assistant"}, {"content", "Hel"}}));
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"].size(), 3u);
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size(), 2u);
  // The worker got the chat format's stop ids and the sampling params.
  auto got = worker_->received().back();
  EXPECT_EQ(got.params.stop_token_ids, std::vector<int32_t>{bg::testing::kEos});
  EXPECT_EQ(got.params.max_tokens, 3);
  EXPECT_EQ(got.params.top_logprobs, 2);
}

TEST_F(FrontendTest, StreamedChatWithUsage) {
  start(hello_script);
  auto events = stream("/v1/chat/completions",
                       json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 8}, {"stream", true},
                            {"stream_options", {{"include_usage", true}}}});
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  std::string finish;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    json c = json::parse(events[i]);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    if (i == 0) {
      EXPECT_EQ(c["choices"][0]["delta"]["role"], "assistant");
    }
    text += c["choices"][0]["delta"].value("content", "");
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(text, "Hello wo");
  EXPECT_EQ(finish, "length");
  json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 8);
}

TEST_F(FrontendTest, ToolCallDeltasStreamedAndNot) {
  using namespace bg::testing;
  start([](const proto::GenerateRequest&) {
    std::vector<int32_t> t = {kThink, 'o', 'k', kThinkEnd, kTool};
    for (int32_t b : bytes_to_ids("lookup:{\"city\":\"Paris\"}")) t.push_back(b);
    t.push_back(kToolEnd);
    t.push_back(kEos);
    return t;
  });
  const json body = {{"messages", {{{"role", "user"}, {"content", "weather?"}}}},
                     {"tools", {{{"type", "function"}, {"function", {{"name", "lookup"}}}}}}};
  auto res = post("/v1/chat/completions", body.dump());
  ASSERT_EQ(res->status, 200) << res->body;
  json choice = json::parse(res->body)["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["reasoning_content"], "ok");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "lookup");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Paris\"}");

  json sbody = body;
  sbody["stream"] = true;
  auto events = stream("/v1/chat/completions", sbody);
  std::string args, name, reasoning, finish;
  int with_id = 0;
  for (const std::string& e : events) {
    if (e == "[DONE]") break;
    json c = json::parse(e)["choices"][0];
    reasoning += c["delta"].value("reasoning_content", "");
    for (const json& tc : c["delta"].value("tool_calls", json::array())) {
      EXPECT_EQ(tc["index"], 0);
      if (tc.contains("id")) ++with_id;
      name += tc["function"].value("name", "");
      args += tc["function"].value("arguments", "");
    }
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
  }
  EXPECT_EQ(with_id, 1);
  EXPECT_EQ(name, "lookup");
  EXPECT_EQ(args, "{\"city\":\"Paris\"}");
  EXPECT_EQ(reasoning, "ok");
  EXPECT_EQ(finish, "tool_calls");
}

TEST_F(FrontendTest, StopStringTrimsAndCancelsAtWorker) {
  start(hello_script);
  auto res = post("/v1/completions", R"({"prompt": "hi", "max_tokens": 20, "stop": ["xx", "wor"]})");
  ASSERT_EQ(res->status, 200) << res->body;
  json r = json::parse(res->body);
  EXPECT_EQ(r["choices"][0]["text"], "Hello ");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(eventually([&] { return worker_->cancelled().size() == 1 && worker_->active() == 0; }));

  auto events = stream("/v1/completions", json{{"prompt", "hi"}, {"max_tokens", 20}, {"stop", "wor"}, {"stream", true}});
  std::string text;
  for (const std::string& e : events) {
    if (e != "[DONE]") text += json::parse(e)["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, "Hello ");
}

TEST_F(FrontendTest, ClientDisconnectCancelsAtWorker) {
  start([](const proto::GenerateRequest&) { return std::vector<int32_t>(5000, 'a'); });
  worker_->max_model_len = 100000;
  worker_->token_delay_ms = 5;
  ASSERT_TRUE(eventually([&] { return link_->max_model_len() == 100000; }));
  httplib::Client cli("127.0.0.1", port_);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = json{{"messages", {{{"role", "user"}, {"content", "go"}}}}, {"max_tokens", 4000}, {"stream", true}}.dump();
  req.set_header("Content-Type", "application/json");
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
  auto res = cli.send(req);
  EXPECT_GE(chunks, 3);
  cli.stop();
  EXPECT_TRUE(eventually([&] { return worker_->cancelled().size() == 1 && worker_->active() == 0; }));
  auto m = get("/metrics");
  EXPECT_TRUE(eventually([&] {
    auto text = get("/metrics")->body;
    return text.find("batchgen_requests_cancelled_total 1\n") != std::string::npos &&
           text.find("batchgen_kv_blocks_used{rank=\"0\"} 0\n") != std::string::npos &&
           text.find("batchgen_requests_in_flight 0\n") != std::string::npos;
  })) << get("/metrics")->body;
}

// A non-streamed request that runs longer than the keep-alive interval: the body (after leading whitespace) is the
// usual JSON; a client that gives up while waiting is noticed by the whitespace probe and cancelled at the worker.
TEST_F(FrontendTest, LongNonStreamedRequestAnswersAndDisconnectCancels) {
  start([](const proto::GenerateRequest&) { return std::vector<int32_t>(5000, 'a'); });
  worker_->max_model_len = 100000;
  worker_->token_delay_ms = 5;
  ASSERT_TRUE(eventually([&] { return link_->max_model_len() == 100000; }));
  auto res = post("/v1/completions", R"({"prompt": "hi", "max_tokens": 300})");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  json r = json::parse(res->body);
  EXPECT_EQ(r["choices"][0]["text"].get<std::string>(), std::string(300, 'a'));
  EXPECT_EQ(r["usage"]["completion_tokens"], 300);

  httplib::Client cli("127.0.0.1", port_);
  cli.set_read_timeout(0, 500000);  // gives up after 0.5 s of a generation that takes seconds
  auto gone = cli.Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 4000})", "application/json");
  cli.stop();
  EXPECT_TRUE(eventually([&] { return worker_->cancelled().size() == 1 && worker_->active() == 0; }));
  EXPECT_TRUE(eventually([&] {
    return get("/metrics")->body.find("batchgen_requests_cancelled_total 1\n") != std::string::npos;
  })) << get("/metrics")->body;
}

TEST_F(FrontendTest, WorkerQueueFullIs429) {
  start(hello_script);
  worker_->reject_code = 429;
  auto res = post("/v1/completions", R"({"prompt": "hi"})");
  ASSERT_EQ(res->status, 429) << res->body;
  EXPECT_EQ(error_of(res)["type"], "rate_limit_error");
  res = post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "stream": true})");
  ASSERT_EQ(res->status, 429) << res->body;
  worker_->reject_code = 503;
  res = post("/v1/completions", R"({"prompt": "hi"})");
  EXPECT_EQ(res->status, 503);
  worker_->reject_code = 0;
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "hi"})")->status, 200);
}

TEST_F(FrontendTest, BadRequestsGetOpenAiErrorsAndServingContinues) {
  FrontendConfig cfg;
  cfg.max_body_bytes = 4096;
  start(hello_script, cfg);
  struct Case {
    std::string path, body;
    int status;
    std::string param;
  };
  const std::string long_prompt(100, 'x');
  const std::vector<Case> cases = {
      {"/v1/completions", "{bad json", 400, ""},
      {"/v1/completions", "{\"prompt\": \"\xff\xfe\"}", 400, ""},
      {"/v1/completions", R"({"prompt": 5})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": "x", "model": "other"})", 404, "model"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 0})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt": ")" + long_prompt + R"("})", 400, "prompt"},
      {"/v1/completions", R"({"prompt": "abc", "max_tokens": 62})", 400, "max_tokens"},
      {"/v1/completions", R"({"prompt": [1, 999]})", 400, "prompt"},
      {"/v1/chat/completions", R"({"messages": []})", 400, "messages"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": ["part"]}]})", 400, "messages"},
      {"/v1/completions", "{\"prompt\": \"" + std::string(5000, 'a') + "\"}", 413, ""},
      {"/v1/nothing", "{}", 404, ""},
  };
  for (const Case& c : cases) {
    auto res = post(c.path, c.body);
    ASSERT_TRUE(res) << c.body.substr(0, 80);
    EXPECT_EQ(res->status, c.status) << c.body.substr(0, 80) << " -> " << res->body;
    json e = error_of(res);
    EXPECT_TRUE(e["message"].is_string());
    EXPECT_TRUE(e["type"].is_string());
    if (!c.param.empty()) {
      EXPECT_EQ(e["param"], c.param) << res->body;
    }
  }
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "hi", "max_tokens": 2})")->status, 200);
  EXPECT_NE(get("/metrics")->body.find("batchgen_requests_total{endpoint=\"/v1/completions\",status=\"400\"}"),
            std::string::npos);
}

TEST_F(FrontendTest, ApiKeyModelsHealthReady) {
  FrontendConfig cfg;
  cfg.api_key = "sekrit";
  start(hello_script, cfg);
  auto res = post("/v1/completions", R"({"prompt": "hi"})");
  EXPECT_EQ(res->status, 401);
  EXPECT_EQ(error_of(res)["type"], "authentication_error");
  res = post("/v1/completions", R"({"prompt": "hi"})", {{"Authorization", "Bearer wrong"}});
  EXPECT_EQ(res->status, 401);
  res = post("/v1/completions", R"({"prompt": "hi", "max_tokens": 1})", {{"Authorization", "Bearer sekrit"}});
  EXPECT_EQ(res->status, 200);

  httplib::Client cli("127.0.0.1", port_);
  auto models = cli.Get("/v1/models", {{"Authorization", "Bearer sekrit"}});
  ASSERT_EQ(models->status, 200);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "tiny");
  EXPECT_EQ(get("/health")->status, 200);
  EXPECT_EQ(get("/ready")->status, 200);

  link_->mark_exited(0, "the worker process was killed by signal 9 (Killed)");
  auto ready = get("/ready");
  EXPECT_EQ(ready->status, 503);
  EXPECT_NE(ready->body.find("rank 0"), std::string::npos) << ready->body;
  EXPECT_NE(ready->body.find("signal 9"), std::string::npos) << ready->body;
  EXPECT_EQ(get("/health")->status, 503);
  res = post("/v1/completions", R"({"prompt": "hi"})", {{"Authorization", "Bearer sekrit"}});
  EXPECT_EQ(res->status, 503);
}

}  // namespace
}  // namespace bg::frontend
