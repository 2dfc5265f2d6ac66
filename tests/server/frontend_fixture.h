// The HTTP frontend in-process against the scripted fake worker over inproc ZeroMQ, with the test HTTP client.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "fake_text_model.h"
#include "fake_worker.h"
#include "http_test_client.h"
#include "server/frontend/http_server.h"
#include "server/frontend/worker_link.h"

namespace bg::frontend {

using namespace std::chrono_literals;

inline std::vector<int32_t> hello_script(const proto::GenerateRequest&) {
  return bg::testing::bytes_to_ids("Hello world, and more.");
}

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
    const int64_t vocab = model != nullptr ? model->vocab_size() : model_.vocab_size();
    static std::atomic<int> n{0};
    const std::string endpoint = "inproc://frontend-test-" + std::to_string(n++);
    link_ = std::make_unique<WorkerLink>(ctx_, endpoint, 1);
    link_->start();
    worker_ = std::make_unique<bg::testing::FakeWorker>(ctx_, endpoint, std::move(script), max_model_len, vocab);
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
  bg::testing::HttpResult post(const std::string& path, const std::string& body,
                               std::vector<std::pair<std::string, std::string>> headers = {}) {
    return bg::testing::http_request(port_, "POST", path, body, headers);
  }
  bg::testing::HttpResult get(const std::string& path,
                              std::vector<std::pair<std::string, std::string>> headers = {}) {
    return bg::testing::http_request(port_, "GET", path, "", headers);
  }
  std::string metrics() { return get("/metrics").body; }
  // A streamed request: the "data:" payloads in order (the last one is "[DONE]").
  std::vector<std::string> stream(const std::string& path, const nlohmann::json& body) {
    auto res = post(path, body.dump());
    EXPECT_EQ(res.status, 200) << res.body;
    EXPECT_EQ(res.header("content-type"), "text/event-stream");
    std::vector<std::string> out;
    size_t pos = 0;
    const std::string& b = res.body;
    while ((pos = b.find("data: ", pos)) != std::string::npos) {
      const size_t end = b.find("\n\n", pos);
      out.push_back(b.substr(pos + 6, end - pos - 6));
      pos = end;
    }
    return out;
  }
  static nlohmann::json error_of(const bg::testing::HttpResult& res) {
    return nlohmann::json::parse(res.body)["error"];
  }
  // The worker emits `n` tokens slowly (5 ms each) and allows a long context.
  void use_slow_worker() {
    worker_->max_model_len = 100000;
    worker_->token_delay_ms = 5;
    ASSERT_TRUE(eventually([&] { return link_->max_model_len() == 100000; }));
  }

  zmq::context_t ctx_;
  bg::testing::FakeTextModel model_;
  Metrics metrics_;
  std::unique_ptr<WorkerLink> link_;
  std::unique_ptr<bg::testing::FakeWorker> worker_;
  std::unique_ptr<FrontendServer> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace bg::frontend
