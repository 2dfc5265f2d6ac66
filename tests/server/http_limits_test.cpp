// The HTTP layer's bounds and protocol details against the in-process frontend: 405 with Allow, 415, Host checks,
// chunked bodies (and their limit), 100-continue, keep-alive reuse, header and idle deadlines, the connection cap
// and its probe-only reserve, graceful drain, strict parameters, a port in use.
#include "frontend_fixture.h"

namespace bg::frontend {
namespace {

using nlohmann::json;
using bg::testing::HttpResult;
using bg::testing::TestConnection;

const std::string kPost = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";

TEST_F(FrontendTest, WrongMethodIs405WithAllow) {
  start(hello_script);
  HttpResult r = get("/v1/completions");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.header("allow"), "POST");
  EXPECT_EQ(error_of(r)["code"], "method_not_allowed");
  r = post("/health", "{}");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.header("allow"), "GET");
  r = bg::testing::http_request(port_, "DELETE", "/v1/models", "");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(get("/v1/nowhere").status, 404);
  EXPECT_NE(metrics().find("batchgen_requests_total{endpoint=\"/v1/completions\",status=\"405\"} 1"),
            std::string::npos);
}

TEST_F(FrontendTest, NonJsonContentTypeIs415) {
  start(hello_script);
  const std::string body = R"({"prompt": "hi", "max_tokens": 1})";
  EXPECT_EQ(post("/v1/completions", body, {{"Content-Type", "text/plain"}}).status, 415);
  EXPECT_EQ(post("/v1/completions", body, {{"Content-Type", "application/x-www-form-urlencoded"}}).status, 415);
  EXPECT_EQ(post("/v1/completions", body, {{"Content-Type", "application/json; charset=latin-1"}}).status, 415);
  EXPECT_EQ(post("/v1/completions", body, {{"Content-Type", "application/json"}, {"Content-Encoding", "gzip"}}).status,
            415);
  EXPECT_EQ(post("/v1/completions", body, {{"Content-Type", "Application/JSON; charset=UTF-8"}}).status, 200);
}

TEST_F(FrontendTest, AllowedHostsRefuseOtherHostHeaders) {
  FrontendConfig cfg;
  cfg.allowed_hosts = {"localhost", "api.example.com"};
  start(hello_script, cfg);
  auto with_host = [&](const std::string& host, const std::string& path) {
    TestConnection c(port_);
    c.send_raw("GET " + path + " HTTP/1.1\r\nHost: " + host + "\r\n\r\n");
    return c.read_response().status;
  };
  EXPECT_EQ(with_host("evil.example.net", "/v1/models"), 403);
  EXPECT_EQ(with_host("localhost:8000", "/v1/models"), 200);
  EXPECT_EQ(with_host("API.example.com", "/v1/models"), 200);
  EXPECT_EQ(with_host("evil.example.net", "/health"), 200);  // probes are exempt (orchestrators use the pod IP)
  EXPECT_EQ(with_host("evil.example.net", "/ready"), 200);
}

TEST_F(FrontendTest, ChunkedBodiesAreReadAndLimited) {
  FrontendConfig cfg;
  cfg.max_body_bytes = 4096;
  start(hello_script, cfg);
  auto chunked = [](const std::string& data, size_t piece) {
    std::string out;
    for (size_t i = 0; i < data.size(); i += piece) {
      const std::string p = data.substr(i, piece);
      out += fmt::format("{:x}\r\n{}\r\n", p.size(), p);
    }
    return out + "0\r\n\r\n";
  };
  const std::vector<std::pair<std::string, std::string>> te = {{"Transfer-Encoding", "chunked"}};
  HttpResult r = post("/v1/completions", chunked(R"({"prompt": "hi", "max_tokens": 3})", 5), te);
  EXPECT_EQ(r.status, 200) << r.body;
  // Over the limit in a chunked body: 413, and the server keeps serving.
  r = post("/v1/completions", chunked("{\"prompt\": \"" + std::string(10000, 'a') + "\"}", 1000), te);
  EXPECT_EQ(r.status, 413) << r.body;
  EXPECT_TRUE(r.closed);
  // A body that never ends (a huge chunk announced): refused at the limit, not buffered.
  TestConnection c(port_);
  c.send_raw(kPost + "Transfer-Encoding: chunked\r\n\r\n40000000\r\n" + std::string(8192, 'a'));
  EXPECT_EQ(c.read_response().status, 413);
  // Malformed chunk framing: 400.
  r = post("/v1/completions", "zz\r\nabc\r\n0\r\n\r\n", te);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "hi", "max_tokens": 1})").status, 200);
}

TEST_F(FrontendTest, ExpectContinueAndKeepAlive) {
  start(hello_script);
  TestConnection c(port_);
  const std::string body = R"({"prompt": "hi", "max_tokens": 2})";
  c.send_raw(kPost + "Expect: 100-continue\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n");
  // The interim 100 arrives before the body is sent (read_response skips it and waits for the final response).
  c.send_raw(body);
  HttpResult r = c.read_response();
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_FALSE(r.closed);
  // The same connection serves the next requests.
  c.send_raw("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(c.read_response().status, 200);
  c.send_raw(kPost + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  EXPECT_EQ(c.read_response().status, 200);
}

TEST_F(FrontendTest, HeaderAndIdleDeadlinesCloseConnections) {
  FrontendConfig cfg;
  cfg.header_timeout = 300ms;
  cfg.keep_alive_timeout = 300ms;
  start(hello_script, cfg);
  TestConnection silent(port_);        // connects and sends nothing
  TestConnection slow(port_);          // a slowloris: a header that never ends
  slow.send_raw("GET /health HTTP/1.1\r\nHost: x\r\n");
  TestConnection idle(port_);          // one request, then idle on keep-alive
  idle.send_raw("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(idle.read_response().status, 200);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(silent.closed_by_server(3000));
  EXPECT_TRUE(slow.closed_by_server(3000));
  EXPECT_TRUE(idle.closed_by_server(3000));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
}

TEST_F(FrontendTest, ConnectionCapKeepsProbesAnswered) {
  FrontendConfig cfg;
  cfg.max_connections = 4;
  cfg.reserve_connections = 2;
  // The incomplete headers below must keep their reserve slots however slowly this test runs under load.
  cfg.reserve_header_timeout = std::chrono::milliseconds(60'000);
  start(hello_script, cfg);
  std::vector<std::unique_ptr<TestConnection>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<TestConnection>(port_));
    held.back()->send_raw("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");  // keep-alive: they stay open
    ASSERT_EQ(held.back()->read_response().status, 200);
  }
  // Beyond the cap: the probes are answered (then the connection closes); everything else gets 503.
  HttpResult r = get("/health");
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(r.closed);
  EXPECT_EQ(get("/ready").status, 200);
  // The two probes' connections hold both reserve slots until the server has read their close; a request that
  // arrives before then is refused at accept (status 0). Once a slot is free it must get the 503.
  ASSERT_TRUE(eventually([&] {
    r = post("/v1/completions", R"({"prompt": "hi"})");
    return r.status != 0;
  }));
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(error_of(r)["code"], "too_many_connections");
  // Beyond cap + reserve: closed at once. Once the probes above have left the reserve, two incomplete headers fill it.
  ASSERT_TRUE(eventually([&] { return server_->reserve_connections_open() == 0; }));
  TestConnection first_extra(port_), second_extra(port_);
  first_extra.send_raw("GET /health HTTP/1.1\r\nHost: x\r\n");
  second_extra.send_raw("GET /health HTTP/1.1\r\nHost: x\r\n");
  ASSERT_TRUE(eventually([&] { return server_->reserve_connections_open() == 2; }));
  EXPECT_EQ(get("/health").status, 0) << "the reserve is 2 connections";
  // Freeing regular slots lets full service resume.
  held.clear();
  EXPECT_TRUE(eventually([&] { return post("/v1/completions", R"({"prompt": "hi", "max_tokens": 1})").status == 200; }));
}

TEST_F(FrontendTest, DrainFinishesInFlightAndRefusesNewWork) {
  start([](const proto::GenerateRequest&) { return std::vector<int32_t>(5000, 'a'); });
  use_slow_worker();
  TestConnection streaming(port_), waiting(port_), idle(port_);
  const std::string body = R"({"prompt": "hi", "max_tokens": 100, "stream": true})";
  streaming.send_raw(kPost + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
  idle.send_raw("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  ASSERT_EQ(idle.read_response().status, 200);
  ASSERT_TRUE(eventually([&] { return server_->active_requests() == 1 && worker_->active() == 1; }));
  server_->begin_drain();
  EXPECT_TRUE(idle.closed_by_server(2000)) << "idle keep-alive connections close at once";
  EXPECT_TRUE(eventually([&] { return !TestConnection(port_).ok(); })) << "no new connections";
  HttpResult r = streaming.read_response(10000);
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.body.find("\"finish_reason\":\"length\""), std::string::npos) << r.body.substr(0, 200);
  EXPECT_NE(r.body.find("data: [DONE]"), std::string::npos);
  EXPECT_TRUE(eventually([&] { return server_->active_requests() == 0; }));
}

TEST_F(FrontendTest, StrictParamsRejectUnknownFields) {
  FrontendConfig cfg;
  cfg.strict_params = true;
  start(hello_script, cfg);
  HttpResult r = post("/v1/completions", R"({"prompt": "hi", "temprature": 0.5})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(error_of(r)["param"], "temprature");
  EXPECT_NE(error_of(r)["message"].get<std::string>().find("did you mean 'temperature'"), std::string::npos);
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "hi", "max_tokens": 1, "user": "u1"})").status, 200);
}

TEST_F(FrontendTest, UnknownFieldsAreIgnoredWithoutStrictParams) {
  start(hello_script);
  EXPECT_EQ(post("/v1/completions", R"({"prompt": "hi", "max_tokens": 1, "temprature": 0.5})").status, 200);
}

TEST_F(FrontendTest, SecondServerOnTheSamePortFails) {
  start(hello_script);
  FrontendServer other(FrontendConfig{}, model_, *link_, metrics_);
  try {
    other.bind("127.0.0.1", port_);
    FAIL() << "bound a port that is in use";
  } catch (const bg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("already in use"), std::string::npos) << e.what();
  }
}

// stop() on another thread right as listen() starts the server: whichever runs first, no I/O thread is left joinable.
// Before start() and stop() shared stop_mu, a stop() that ran first left start() to make threads that nothing joined
// (std::terminate when the server was destroyed; seen as this fixture's SecondServerOnTheSamePortFails aborting).
TEST_F(FrontendTest, StopRacingListenLeavesNoThreadBehind) {
  start(hello_script);
  for (int i = 0; i < 100; ++i) {
    FrontendServer server(FrontendConfig{}, model_, *link_, metrics_);
    server.bind("127.0.0.1", 0);
    std::thread listener([&] { server.listen(); });
    if (i % 2 == 1) std::this_thread::sleep_for(std::chrono::microseconds(200));  // some iterations start first
    server.stop();
    listener.join();
  }
}

}  // namespace
}  // namespace bg::frontend
