// The HTTP frontend in-process against a scripted fake worker over ZeroMQ: non-streamed and streamed responses,
// tool-call deltas, stop strings and client disconnects cancelling at the worker, rejections and failures with their
// real status, bad input, the API key, readiness.
#include "frontend_fixture.h"

namespace bg::frontend {
namespace {

using nlohmann::json;
using bg::testing::bytes_to_ids;

TEST_F(FrontendTest, NonStreamedCompletionAndChat) {
  start(hello_script);
  auto res = post("/v1/completions", R"({"model": "tiny", "prompt": "hi", "max_tokens": 5})");
  ASSERT_NE(res.status, 0);
  ASSERT_EQ(res.status, 200) << res.body;
  json r = json::parse(res.body);
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["choices"][0]["text"], "Hello");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r["usage"], (json{{"prompt_tokens", 2}, {"completion_tokens", 5}, {"total_tokens", 7},
                              {"prompt_tokens_details", {{"cached_tokens", 0}}}}));

  res = post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                         "logprobs": true, "top_logprobs": 2})");
  ASSERT_EQ(res.status, 200) << res.body;
  r = json::parse(res.body);
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
  ASSERT_EQ(res.status, 200) << res.body;
  json choice = json::parse(res.body)["choices"][0];
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
  ASSERT_EQ(res.status, 200) << res.body;
  json r = json::parse(res.body);
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
  use_slow_worker();
  int chunks = 0;
  const std::string body =
      json{{"messages", {{{"role", "user"}, {"content", "go"}}}}, {"max_tokens", 4000}, {"stream", true}}.dump();
  bg::testing::http_request(port_, "POST", "/v1/chat/completions", body, {}, 10000,
                            [&](const std::string&) { return ++chunks < 3; });
  EXPECT_GE(chunks, 3);
  EXPECT_TRUE(eventually([&] { return worker_->cancelled().size() == 1 && worker_->active() == 0; }));
  EXPECT_TRUE(eventually([&] {
    const std::string text = metrics();
    return text.find("batchgen_requests_cancelled_total 1\n") != std::string::npos &&
           text.find("batchgen_kv_blocks_used{rank=\"0\"} 0\n") != std::string::npos &&
           text.find("batchgen_requests_in_flight 0\n") != std::string::npos;
  })) << metrics();
}

// A non-streamed request that runs for seconds is answered as one JSON body with its real status (no early 200);
// a client that gives up while waiting is noticed from the socket at once and cancelled at the worker.
TEST_F(FrontendTest, LongNonStreamedRequestAnswersAndDisconnectCancels) {
  start([](const proto::GenerateRequest&) { return std::vector<int32_t>(5000, 'a'); });
  use_slow_worker();
  auto res = post("/v1/completions", R"({"prompt": "hi", "max_tokens": 300})");
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_EQ(res.body.front(), '{');
  json r = json::parse(res.body);
  EXPECT_EQ(r["choices"][0]["text"].get<std::string>(), std::string(300, 'a'));
  EXPECT_EQ(r["usage"]["completion_tokens"], 300);

  const auto t0 = std::chrono::steady_clock::now();
  auto gone = bg::testing::http_request(port_, "POST", "/v1/completions", R"({"prompt": "hi", "max_tokens": 4000})",
                                        {}, /*timeout_ms=*/500);  // gives up after 0.5 s, closing the connection
  EXPECT_EQ(gone.status, 0);
  EXPECT_TRUE(eventually([&] { return worker_->cancelled().size() == 1 && worker_->active() == 0; }));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s) << "the cancel follows the hang-up at once";
  EXPECT_TRUE(eventually([&] {
    return metrics().find("batchgen_requests_cancelled_total 1\n") != std::string::npos;
  })) << metrics();
}

// A generation that fails after running a while answers with the failure's status, never 200 + an error body.
TEST_F(FrontendTest, FailureAfterSecondsKeepsItsStatus) {
  start([](const proto::GenerateRequest&) { return std::vector<int32_t>(5000, 'a'); });
  use_slow_worker();
  worker_->fail_after = 250;  // ~1.3 s of tokens, then the step fails
  auto res = post("/v1/completions", R"({"prompt": "hi", "max_tokens": 1000})");
  EXPECT_EQ(res.status, 500) << res.body;
  EXPECT_EQ(error_of(res)["type"], "server_error");
  worker_->fail_code = 503;
  res = post("/v1/completions", R"({"prompt": "hi", "max_tokens": 1000})");
  EXPECT_EQ(res.status, 503) << res.body;
  // Streamed: the 200 is committed with the first token; the failure ends the stream with an error event.
  auto events = stream("/v1/completions", json{{"prompt", "hi"}, {"max_tokens", 1000}, {"stream", true}});
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(json::parse(events[events.size() - 2])["error"]["code"], nullptr);
  EXPECT_EQ(json::parse(events[events.size() - 2])["error"]["type"], "service_unavailable_error");
}

TEST_F(FrontendTest, WorkerQueueFullIs429) {
  start(hello_script);
  worker_->reject_code = 429;
  auto res = post("/v1/completions", R"({"prompt": "hi"})");
  ASSERT_EQ(res.status, 429) << res.body;
  EXPECT_EQ(error_of(res)["type"], "rate_limit_error");
  res = post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "stream": true})");
  ASSERT_EQ(res.status, 429) << res.body;
  worker_->reject_code = 503;
  res = post("/v1/completions", R"({"prompt": "hi"})");
  EXPECT_EQ(res.status, 503);
  worker_->reject_code = 0;
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "hi"})").status, 200);
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
  // The body is level 1; the array opened at level 129 is refused, named by the path of the 124 arrays above it.
  std::string deep_param = "tools[0].function.parameters";
  for (int i = 0; i < 124; ++i) deep_param += "[0]";
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
      {"/v1/completions", R"({"prompt": "x", "temperature": 1e400})", 400, "temperature"},
      {"/v1/completions", R"({"prompt": "x", "extra": )" + std::string(200, '[') + std::string(200, ']') + "}", 400,
       ""},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": 5}]})", 400,
       "tools[0]"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": 1}})",
       400, "response_format"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
        "function": {"name": "f", "parameters": )" + std::string(150, '[') + std::string(150, ']') + "}}]}", 400,
       deep_param},
  };
  for (const Case& c : cases) {
    auto res = post(c.path, c.body);
    ASSERT_NE(res.status, 0) << c.body.substr(0, 80);
    EXPECT_EQ(res.status, c.status) << c.body.substr(0, 80) << " -> " << res.body;
    json e = error_of(res);
    EXPECT_TRUE(e["message"].is_string());
    EXPECT_TRUE(e["type"].is_string());
    if (!c.param.empty()) {
      EXPECT_EQ(e["param"], c.param) << res.body;
    }
    EXPECT_EQ(e["message"].get<std::string>().find("json.exception"), std::string::npos) << "no internal text";
  }
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "hi", "max_tokens": 2})").status, 200);
  EXPECT_NE(metrics().find("batchgen_requests_total{endpoint=\"/v1/completions\",status=\"400\"}"),
            std::string::npos);
}

TEST_F(FrontendTest, ApiKeyModelsHealthReady) {
  FrontendConfig cfg;
  cfg.api_key = "sekrit";
  start(hello_script, cfg);
  auto res = post("/v1/completions", R"({"prompt": "hi"})");
  EXPECT_EQ(res.status, 401);
  EXPECT_EQ(error_of(res)["type"], "authentication_error");
  res = post("/v1/completions", R"({"prompt": "hi"})", {{"Authorization", "Bearer wrong"}});
  EXPECT_EQ(res.status, 401);
  res = post("/v1/completions", R"({"prompt": "hi", "max_tokens": 1})", {{"Authorization", "Bearer sekrit"}});
  EXPECT_EQ(res.status, 200);

  EXPECT_EQ(get("/v1/models").status, 401);
  auto models = get("/v1/models", {{"Authorization", "Bearer sekrit"}});
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(json::parse(models.body)["data"][0]["id"], "tiny");
  EXPECT_EQ(get("/health").status, 200);  // probes need no key
  EXPECT_EQ(get("/ready").status, 200);

  link_->mark_exited(0, "the worker process was killed by signal 9 (Killed)");
  auto ready = get("/ready");
  EXPECT_EQ(ready.status, 503);
  EXPECT_NE(ready.body.find("rank 0"), std::string::npos) << ready.body;
  EXPECT_NE(ready.body.find("signal 9"), std::string::npos) << ready.body;
  EXPECT_EQ(json::parse(ready.body)["ranks"][0]["state"], "exited");
  EXPECT_NE(metrics().find("batchgen_worker_ready{rank=\"0\"} 0\n"), std::string::npos);
  EXPECT_NE(metrics().find("batchgen_worker_up{rank=\"0\"} 0\n"), std::string::npos);
  // /health stays 200 while the supervisor can still restart the worker; 503 once it gave up.
  EXPECT_EQ(get("/health").status, 200);
  link_->set_supervisor_note(0, "gave up after 5 restarts in a row", /*gave_up=*/true);
  EXPECT_EQ(get("/health").status, 503);
  EXPECT_NE(get("/health").body.find("gave up"), std::string::npos);
  res = post("/v1/completions", R"({"prompt": "hi"})", {{"Authorization", "Bearer sekrit"}});
  EXPECT_EQ(res.status, 503);
}

}  // namespace
}  // namespace bg::frontend
