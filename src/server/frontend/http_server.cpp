// The listener and the server's lifecycle: bind (no SO_REUSEPORT: a port in use is an error), accept with the
// connection cap and its probe-only reserve, the I/O threads, the preparation pool, drain and stop.
#include "server/frontend/http_server.h"

#include <fmt/format.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>

#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "server/frontend/http_connection.h"

namespace bg::frontend {

namespace {

// At most one line a second about refused connections (a flood must not flood the log).
class RateLimitedWarning {
 public:
  void warn(const std::string& what) {
    ++n_;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::seconds(1)) return;
    last_ = now;
    log::warn("frontend: {} ({} so far)", what, n_);
  }

 private:
  std::chrono::steady_clock::time_point last_;
  uint64_t n_ = 0;
};

tcp::endpoint resolve_endpoint(const std::string& host, int port) {
  beast::error_code ec;
  const net::ip::address addr = net::ip::make_address(host, ec);
  if (!ec) return tcp::endpoint(addr, static_cast<unsigned short>(port));
  net::io_context ioc;
  tcp::resolver resolver(ioc);
  auto results = resolver.resolve(host, std::to_string(port), ec);
  BG_CHECK(!ec && !results.empty(), "--host {}: cannot resolve the address: {}", host, ec.message());
  return results.begin()->endpoint();
}

}  // namespace

struct FrontendServer::Impl {
  Impl(FrontendConfig c, const TextModel& model, WorkerLink& link, Metrics& metrics)
      : cfg(std::move(c)),
        ctx{model, link, metrics, cfg.served_model_name, ParseOptions{cfg.strict_params}},
        router(RouteConfig{cfg.api_key, cfg.allowed_hosts, cfg.max_body_bytes}, ctx),
        prep(std::max<size_t>(cfg.n_prep_threads, 1)),
        core(cfg, router, metrics, prep),
        ioc(static_cast<int>(std::max<size_t>(cfg.n_io_threads, 1))),
        work(net::make_work_guard(ioc)),
        acceptor(net::make_strand(ioc)),
        retry_timer(acceptor.get_executor()) {}

  void accept();
  void on_accept(beast::error_code ec, tcp::socket socket);

  FrontendConfig cfg;
  ServingContext ctx;
  Router router;
  net::thread_pool prep;
  HttpCore core;
  net::io_context ioc;  // destroyed before `core`: pending handlers release their connections first
  net::executor_work_guard<net::io_context::executor_type> work;
  tcp::acceptor acceptor;
  net::steady_timer retry_timer;
  std::vector<std::thread> threads;
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopped = false;
  RateLimitedWarning refused;
};

void FrontendServer::Impl::accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    on_accept(ec, std::move(socket));
  });
}

void FrontendServer::Impl::on_accept(beast::error_code ec, tcp::socket socket) {
  if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
  if (ec) {
    // Out of file descriptors (or similar): wait a little instead of spinning on the error.
    refused.warn(fmt::format("accept failed: {}", ec.message()));
    retry_timer.expires_after(std::chrono::milliseconds(50));
    retry_timer.async_wait([this](beast::error_code e) {
      if (!e) accept();
    });
    return;
  }
  beast::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  bool limited = false;
  if (core.n_connections.fetch_add(1) >= cfg.max_connections) {
    --core.n_connections;
    if (core.n_limited.fetch_add(1) >= cfg.reserve_connections) {
      --core.n_limited;
      refused.warn(fmt::format("refused a connection: {} connections plus {} reserve are open (--max-connections)",
                               cfg.max_connections, cfg.reserve_connections));
      socket.close(ignored);
      accept();
      return;
    }
    limited = true;
  }
  std::make_shared<Connection>(std::move(socket), core, limited)->start();
  accept();
}

FrontendServer::FrontendServer(FrontendConfig cfg, const TextModel& model, WorkerLink& link, Metrics& metrics)
    : impl_(std::make_unique<Impl>(std::move(cfg), model, link, metrics)) {}

FrontendServer::~FrontendServer() { stop(); }

int FrontendServer::bind(const std::string& host, int port) {
  const tcp::endpoint ep = resolve_endpoint(host, port);
  tcp::acceptor& a = impl_->acceptor;
  beast::error_code ec;
  a.open(ep.protocol(), ec);
  BG_CHECK(!ec, "cannot listen on {}:{}: {}", host, port, ec.message());
  // SO_REUSEADDR only lets a restarted server bind past connections in TIME_WAIT; without SO_REUSEPORT a second
  // server on the same port fails here instead of silently sharing (and stealing) its traffic.
  a.set_option(net::socket_base::reuse_address(true), ec);
  a.bind(ep, ec);
  if (ec == net::error::address_in_use) {
    fail("cannot listen on {}:{}: the address is already in use (is another `batchgen serve` running on port {}? "
         "choose another --port)", host, port, port);
  }
  BG_CHECK(!ec, "cannot listen on {}:{}: {}", host, port, ec.message());
  a.listen(net::socket_base::max_listen_connections, ec);
  BG_CHECK(!ec, "cannot listen on {}:{}: {}", host, port, ec.message());
  return a.local_endpoint().port();
}

void FrontendServer::start() {
  Impl& s = *impl_;
  // Under stop_mu, so that a stop() on another thread either sees the I/O threads (and joins them) or makes this
  // start nothing: a stop() that ran between the check and the emplace left joinable threads behind (terminate).
  std::lock_guard lock(s.stop_mu);
  if (s.stopped || !s.threads.empty()) return;
  BG_CHECK(s.acceptor.is_open(), "FrontendServer::start: bind() first");
  net::post(s.acceptor.get_executor(), [&s] { s.accept(); });
  for (size_t i = 0; i < std::max<size_t>(s.cfg.n_io_threads, 1); ++i) {
    s.threads.emplace_back([&s] {
      for (;;) {
        try {
          s.ioc.run();
          return;
        } catch (const std::exception& e) {
          // A handler threw: log and keep the I/O thread serving the other connections.
          log::error("frontend: HTTP I/O thread: {}", e.what());
        }
      }
    });
  }
}

bool FrontendServer::listen() {
  start();
  std::unique_lock lock(impl_->stop_mu);
  impl_->stop_cv.wait(lock, [&] { return impl_->stopped; });
  return true;
}

void FrontendServer::begin_drain() {
  Impl& s = *impl_;
  s.core.draining = true;
  s.router.set_draining();
  net::post(s.acceptor.get_executor(), [&s] {
    beast::error_code ignored;
    s.acceptor.close(ignored);
    s.retry_timer.cancel();
  });
  for (const auto& c : s.core.snapshot()) c->drain();
}

size_t FrontendServer::active_requests() const { return impl_->core.n_active.load(); }

size_t FrontendServer::reserve_connections_open() const { return impl_->core.n_limited.load(); }

void FrontendServer::stop() {
  Impl& s = *impl_;
  std::vector<std::thread> threads;  // the I/O threads start() made; none can start after this block
  {
    std::lock_guard lock(s.stop_mu);
    if (s.stopped) return;
    s.stopped = true;
    threads = std::move(s.threads);
    s.threads.clear();
  }
  s.stop_cv.notify_all();
  s.core.draining = true;
  s.router.set_draining();
  if (!threads.empty()) {
    net::post(s.acceptor.get_executor(), [&s] {
      beast::error_code ignored;
      s.acceptor.close(ignored);
      s.retry_timer.cancel();
    });
    for (const auto& c : s.core.snapshot()) c->abort();
    // Let the closes run (each cancels its generation at the worker) before the I/O threads stop.
    for (int i = 0; i < 100 && s.core.n_connections + s.core.n_limited > 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    s.prep.join();  // requests being prepared finish; their results find their connections closed
    s.work.reset();
    s.ioc.stop();
    for (std::thread& t : threads) t.join();
  } else {
    s.prep.join();
  }
}

}  // namespace bg::frontend
