// Internal to the HTTP layer (only http_server.cpp and http_connection.cpp include it, so Beast compiles in two
// translation units): the state shared by all connections, and one connection's state machine.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "server/frontend/http_server.h"
#include "server/frontend/http_types.h"
#include "server/frontend/metrics.h"
#include "server/frontend/routes.h"

namespace bg::frontend {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

class Connection;

// Shared by every connection; owned by the server.
struct HttpCore {
  HttpCore(const FrontendConfig& c, Router& r, Metrics& m, net::thread_pool& p)
      : cfg(c), router(r), metrics(m), prep(p) {}

  const FrontendConfig& cfg;
  Router& router;
  Metrics& metrics;
  net::thread_pool& prep;
  std::atomic<size_t> n_connections{0};   // within --max-connections
  std::atomic<size_t> n_limited{0};       // in the reserve beyond it
  std::atomic<size_t> n_active{0};        // generation requests read and not yet answered
  std::atomic<bool> draining{false};

  void add(const std::shared_ptr<Connection>& c);
  void remove(Connection* c);
  std::vector<std::shared_ptr<Connection>> snapshot();

 private:
  std::mutex mu_;
  std::unordered_map<Connection*, std::weak_ptr<Connection>> conns_;
};

// One client connection. Every member runs on the connection's strand (its socket's executor), except the
// notifier, which only posts to it.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, HttpCore& core, bool limited);
  ~Connection();
  void start();
  // Drain: close now if idle between requests; otherwise close after the current response.
  void drain();
  // Server stop: close now (a generation in progress is cancelled).
  void abort();

 private:
  using Clock = std::chrono::steady_clock;
  enum class Phase { reading, processing, lingering, closed };

  void wait_for_request();
  void read_header();
  void on_header(beast::error_code ec);
  void read_body();
  void on_body(beast::error_code ec);
  void dispatch();
  void on_prepared(RouteResult result);
  void on_progress();
  void start_stream(const HttpResponse& head);
  void send_response(const HttpResponse& r);
  void reject(int status, const std::string& message);
  std::string connection_header(bool close) const;
  void watch();
  void rearm_watch();
  void on_watch(beast::error_code ec, size_t n);
  void client_gone(const char* why);
  void enqueue(std::string bytes);
  void write_next();
  void on_write(beast::error_code ec);
  void finish_response();
  void linger_close();
  void arm_tick();
  void on_tick();
  void close();
  std::chrono::milliseconds header_timeout() const;

  HttpCore& core_;
  const bool limited_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  net::steady_timer tick_;
  Phase phase_ = Phase::reading;
  HttpRequest req_;
  std::string endpoint_;                 // metrics label of the current request
  bool keep_alive_ = true;               // the client allows another request on this connection
  bool http10_ = false;
  bool close_after_ = false;             // close once the current response is written
  bool first_request_ = true;
  bool reading_ = false;                 // a first-bytes, header or body read is pending
  bool watching_ = false;                // a disconnect-watch read is pending
  bool rearm_watch_ = false;             // it is being cancelled to be reissued under a new deadline
  bool counted_active_ = false;          // counted in core_.n_active
  std::unique_ptr<PendingResponse> pending_;
  std::shared_ptr<std::atomic<bool>> notify_posted_ = std::make_shared<std::atomic<bool>>(false);
  bool streaming_ = false;               // a chunked (or, for HTTP/1.0, close-delimited) body is being sent
  bool response_complete_ = false;       // every byte of the response is queued
  std::deque<std::string> out_;
  bool writing_ = false;
  Clock::time_point last_write_;
};

}  // namespace bg::frontend
