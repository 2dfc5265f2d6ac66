// The frontend with the real text model (tiktoken tokenizer + Kimi K3 chat format, files as make-random writes them)
// against the scripted fake worker: K3 tool-call output becomes OpenAI tool_calls, streamed and not; the rendered
// prompt and the chat format's stop id reach the worker.
#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include "fake_worker.h"
#include "http_test_client.h"
#include "server/frontend/http_server.h"
#include "server/frontend/worker_link.h"
#include "server/tokenizer/tokenizer.h"
#include "server/tokenizer/tokenizer_writer.h"
#include "temp_dir.h"

namespace bg::frontend {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

// Special tokens by name ("<|open|>") or BPE-encoded text.
std::vector<int32_t> k3_stream(const Tokenizer& tok, const std::vector<std::string>& pieces) {
  std::vector<int32_t> ids;
  for (const std::string& p : pieces) {
    if (auto id = tok.special_id(p)) {
      ids.push_back(*id);
    } else {
      auto e = tok.encode(p);
      ids.insert(ids.end(), e.begin(), e.end());
    }
  }
  return ids;
}

class K3FrontendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    write_tokenizer_files(dir_.path(), kimi_tokenizer_layout(1024));
    std::ofstream(dir_ / "config.json") << R"({"model_type": "kimi_k3"})";
    model_ = load_text_model(dir_.path().string());
    tok_ = std::make_unique<Tokenizer>(Tokenizer::load(dir_.path()));
    const std::string O = "<|open|>", S = "<|sep|>", C = "<|close|>";
    script_ = k3_stream(*tok_, {"Need weather.", C, "think", S, O, "response", S, "Checking.", C, "response", S, O,
                                "tools", S, O, "call tool=\"get_weather\" index=\"1\"", S, O,
                                "argument key=\"city\" type=\"string\"", S, "Paris", C, "argument", S, C, "call", S, C,
                                "tools", S, C, "message", S, "<|end_of_msg|>"});
    link_ = std::make_unique<WorkerLink>(ctx_, "inproc://k3-frontend-test", 1);
    link_->start();
    worker_ = std::make_unique<bg::testing::FakeWorker>(
        ctx_, "inproc://k3-frontend-test", [this](const proto::GenerateRequest&) { return script_; }, 4096,
        model_->vocab_size());
    FrontendConfig cfg;
    cfg.served_model_name = "k3";
    server_ = std::make_unique<FrontendServer>(cfg, *model_, *link_, metrics_);
    port_ = server_->bind("127.0.0.1", 0);
    thread_ = std::thread([this] { server_->listen(); });
    for (int i = 0; i < 500 && !link_->all_ready(); ++i) std::this_thread::sleep_for(10ms);
    ASSERT_TRUE(link_->all_ready());
  }
  void TearDown() override {
    server_->stop();
    thread_.join();
    worker_.reset();
    link_->stop();
  }
  bg::testing::HttpResult post(const json& body) {
    return bg::testing::http_request(port_, "POST", "/v1/chat/completions", body.dump());
  }

  bg::testing::TempDir dir_;
  std::unique_ptr<TextModel> model_;
  std::unique_ptr<Tokenizer> tok_;
  std::vector<int32_t> script_;
  zmq::context_t ctx_;
  Metrics metrics_;
  std::unique_ptr<WorkerLink> link_;
  std::unique_ptr<bg::testing::FakeWorker> worker_;
  std::unique_ptr<FrontendServer> server_;
  std::thread thread_;
  int port_ = 0;
};

const json kTools = json::array({{{"type", "function"},
                                  {"function", {{"name", "get_weather"},
                                                {"parameters", {{"type", "object"},
                                                                {"properties", {{"city", {{"type", "string"}}}}}}}}}}});

TEST_F(K3FrontendTest, ToolCallsNonStreamed) {
  auto res = post({{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}, {"tools", kTools}});
  ASSERT_NE(res.status, 0);
  ASSERT_EQ(res.status, 200) << res.body;
  json r = json::parse(res.body);
  const json& c = r["choices"][0];
  EXPECT_EQ(c["finish_reason"], "tool_calls");
  EXPECT_EQ(c["message"]["reasoning_content"], "Need weather.");
  EXPECT_EQ(c["message"]["content"], "Checking.");
  ASSERT_EQ(c["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(c["message"]["tool_calls"][0]["type"], "function");
  EXPECT_EQ(c["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(c["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            (json{{"city", "Paris"}}));
  EXPECT_EQ(r["usage"]["completion_tokens"], static_cast<int64_t>(script_.size()));
  // The worker got the rendered K3 prompt (tools declared) and <|end_of_msg|> as a stop id.
  const proto::GenerateRequest got = worker_->received().back();
  EXPECT_NE(tok_->decode(got.prompt).find("get_weather"), std::string::npos);
  EXPECT_EQ(got.params.stop_token_ids, std::vector<int32_t>{*tok_->special_id("<|end_of_msg|>")});
}

TEST_F(K3FrontendTest, ToolCallsStreamedAndToolResultRoundTrip) {
  json messages = {{{"role", "user"}, {"content", "Weather in Paris?"}}};
  auto res = post({{"messages", messages}, {"tools", kTools}, {"stream", true}});
  ASSERT_EQ(res.status, 200) << res.body;
  std::string args, name, id, content;
  std::string finish;
  size_t pos = 0;
  while ((pos = res.body.find("data: ", pos)) != std::string::npos) {
    const size_t end = res.body.find("\n\n", pos);
    const std::string data = res.body.substr(pos + 6, end - pos - 6);
    pos = end;
    if (data == "[DONE]") break;
    const json c = json::parse(data)["choices"][0];
    content += c["delta"].value("content", "");
    for (const json& tc : c["delta"].value("tool_calls", json::array())) {
      id += tc.value("id", "");
      name += tc["function"].value("name", "");
      args += tc["function"].value("arguments", "");
    }
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
  }
  EXPECT_EQ(content, "Checking.");
  EXPECT_EQ(name, "get_weather");
  EXPECT_FALSE(id.empty());
  EXPECT_EQ(json::parse(args), (json{{"city", "Paris"}}));
  EXPECT_EQ(finish, "tool_calls");

  // Feed the call and its result back: the format renders them (a tool message must name a preceding call).
  messages.push_back({{"role", "assistant"},
                      {"content", nullptr},
                      {"tool_calls", {{{"id", id}, {"type", "function"},
                                       {"function", {{"name", name}, {"arguments", args}}}}}}});
  messages.push_back({{"role", "tool"}, {"tool_call_id", id}, {"content", "sunny"}});
  res = post({{"messages", messages}, {"tools", kTools}, {"max_tokens", 4}});
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_NE(tok_->decode(worker_->received().back().prompt).find("sunny"), std::string::npos);
  messages.back()["tool_call_id"] = "call_unknown";
  res = post({{"messages", messages}, {"tools", kTools}});
  EXPECT_EQ(res.status, 400) << res.body;
  EXPECT_EQ(json::parse(res.body)["error"]["param"], "messages");
}

}  // namespace
}  // namespace bg::frontend
