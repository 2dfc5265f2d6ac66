// One HTTP/1.1 connection as a state machine on its strand: wait for a request (idle deadline) -> header (header
// deadline, checks before the body) -> body (body deadline, limit in every transfer encoding) -> route: answered at
// once, or prepared on the pool and then polled as the generation produces output. While a request is processed a
// read stays pending on the socket, so a client that goes away is noticed at once and its generation cancelled.
// Responses are serialized here (status line, headers, Content-Length or chunked framing); Beast parses requests.
#include "server/frontend/http_connection.h"

#include <fmt/format.h>

#include <limits>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>

#include "core/log.h"
#include "server/frontend/api_error.h"

namespace bg::frontend {

namespace {

constexpr size_t kReadChunk = 4096;
constexpr size_t kMaxPipelinedBytes = 64 << 10;  // stop reading ahead (and watching) beyond this much buffered input
// After a response that closes the connection, input is read and dropped this long (or until the client closes),
// so the client reads the response instead of a reset caused by its own unread upload (nginx's lingering close).
constexpr std::chrono::milliseconds kLingerTimeout{2000};

std::string to_lower(beast::string_view s) {
  std::string out(s.data(), s.size());
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string status_line(int status) {
  const beast::string_view reason = http::obsolete_reason(http::int_to_status(static_cast<unsigned>(status)));
  return fmt::format("HTTP/1.1 {} {}\r\n", status, std::string_view(reason.data(), reason.size()));
}

std::string headers_text(const HttpResponse& r) {
  std::string h = "Content-Type: " + r.content_type + "\r\n";
  for (const auto& [k, v] : r.headers) h += k + ": " + v + "\r\n";
  return h;
}

std::string chunk(const std::string& data) { return fmt::format("{:x}\r\n{}\r\n", data.size(), data); }

bool quiet_error(const beast::error_code& ec) {
  return ec == http::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
         ec == net::error::operation_aborted || ec == net::error::connection_reset ||
         ec == http::error::partial_message;
}

}  // namespace

void HttpCore::add(const std::shared_ptr<Connection>& c) {
  std::lock_guard lock(mu_);
  conns_[c.get()] = c;
}

void HttpCore::remove(Connection* c) {
  std::lock_guard lock(mu_);
  conns_.erase(c);
}

std::vector<std::shared_ptr<Connection>> HttpCore::snapshot() {
  std::lock_guard lock(mu_);
  std::vector<std::shared_ptr<Connection>> out;
  for (auto& [_, weak] : conns_) {
    if (auto c = weak.lock()) out.push_back(std::move(c));
  }
  return out;
}

Connection::Connection(tcp::socket socket, HttpCore& core, bool limited)
    : core_(core), limited_(limited), stream_(std::move(socket)), tick_(stream_.get_executor()) {}

Connection::~Connection() {
  core_.remove(this);
  if (counted_active_) --core_.n_active;
  if (pending_) pending_->cancel();
  --(limited_ ? core_.n_limited : core_.n_connections);
}

void Connection::start() {
  core_.add(shared_from_this());
  net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->wait_for_request(); });
}

std::chrono::milliseconds Connection::header_timeout() const {
  return limited_ ? std::min(core_.cfg.header_timeout, core_.cfg.reserve_header_timeout) : core_.cfg.header_timeout;
}

void Connection::drain() {
  net::dispatch(stream_.get_executor(), [self = shared_from_this()] {
    if (self->phase_ == Phase::reading && self->buffer_.size() == 0 && !self->parser_) {
      self->close();
    } else {
      self->close_after_ = true;
    }
  });
}

void Connection::abort() {
  net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->close(); });
}

// Waits for the first byte of the next request: the header deadline for the first request, the keep-alive
// deadline between requests. A watch read left pending by the previous response serves the same purpose.
void Connection::wait_for_request() {
  if (phase_ == Phase::closed) return;
  phase_ = Phase::reading;
  parser_.reset();
  if (core_.draining && !first_request_) {
    close();
    return;
  }
  if (watching_) {
    rearm_watch();  // a watch read is still pending: cancel it; on_watch calls this again
    return;
  }
  if (buffer_.size() > 0) {
    read_header();
    return;
  }
  stream_.expires_after(first_request_ ? header_timeout() : core_.cfg.keep_alive_timeout);
  reading_ = true;
  stream_.async_read_some(buffer_.prepare(kReadChunk), [self = shared_from_this()](beast::error_code ec, size_t n) {
    self->reading_ = false;
    if (ec) {
      self->close();
      return;
    }
    self->buffer_.commit(n);
    self->read_header();
  });
}

void Connection::read_header() {
  parser_.emplace();
  parser_->header_limit(static_cast<uint32_t>(core_.cfg.max_header_bytes));
  // No limit while the header is read (Router::check_head answers a Content-Length over the limit with 413); the real
  // limit is set before the body. (Beast 1.74 compares Content-Length against boost::none as "over the limit".)
  parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
  stream_.expires_after(header_timeout());
  reading_ = true;
  http::async_read_header(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
    self->reading_ = false;
    self->on_header(ec);
  });
}

void Connection::on_header(beast::error_code ec) {
  if (phase_ == Phase::closed) return;
  if (ec) {
    close_after_ = true;
    if (ec == http::error::header_limit) {
      reject(431, fmt::format("The request header is larger than {} bytes", core_.cfg.max_header_bytes));
    } else if (quiet_error(ec)) {
      close();
    } else {
      reject(400, "Malformed HTTP request: " + ec.message());
    }
    return;
  }
  const auto& msg = parser_->get();
  req_ = HttpRequest{};
  req_.method = std::string(msg.method_string());
  req_.target = std::string(msg.target());
  req_.path = req_.target.substr(0, req_.target.find('?'));
  req_.arrival = Clock::now();
  for (const auto& field : msg) req_.headers.emplace_back(to_lower(field.name_string()), std::string(field.value()));
  keep_alive_ = msg.keep_alive();
  http10_ = msg.version() < 11;
  endpoint_ = endpoint_label(req_.path);
  HeadInfo info;
  info.limited = limited_;
  if (auto n = parser_->content_length()) info.content_length = *n;
  info.chunked = parser_->chunked();
  if (std::optional<HttpResponse> refusal = core_.router.check_head(req_, info)) {
    if (!parser_->is_done()) refusal->close = true;  // the body was not read: the connection cannot be reused
    send_response(*refusal);
    return;
  }
  if (parser_->is_done()) {
    dispatch();
    return;
  }
  const std::string* expect = req_.header("expect");
  if (expect != nullptr && to_lower(*expect) == "100-continue" && !http10_) {
    enqueue("HTTP/1.1 100 Continue\r\n\r\n");
  }
  read_body();
}

void Connection::read_body() {
  parser_->body_limit(core_.cfg.max_body_bytes);
  stream_.expires_after(core_.cfg.body_timeout);
  reading_ = true;
  http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
    self->reading_ = false;
    self->on_body(ec);
  });
}

void Connection::on_body(beast::error_code ec) {
  if (phase_ == Phase::closed) return;
  if (ec) {
    close_after_ = true;
    if (ec == http::error::body_limit) {
      reject(413, fmt::format("The request body is larger than the limit of {} bytes", core_.cfg.max_body_bytes));
    } else if (quiet_error(ec)) {
      close();  // the client went away or stalled (the deadline already closed the socket)
    } else {
      reject(400, "Malformed HTTP request body: " + ec.message());
    }
    return;
  }
  req_.body = std::move(parser_->get().body());
  dispatch();
}

void Connection::dispatch() {
  phase_ = Phase::processing;
  parser_.reset();
  if (!Router::is_generation(req_)) {
    send_response(core_.router.handle_get(req_));
    return;
  }
  ++core_.n_active;
  counted_active_ = true;
  stream_.expires_never();
  watch();
  auto req = std::make_shared<HttpRequest>(std::move(req_));
  net::post(core_.prep, [self = shared_from_this(), req] {
    auto result = std::make_shared<RouteResult>(self->core_.router.handle_generation(*req));
    net::post(self->stream_.get_executor(), [self, result] { self->on_prepared(std::move(*result)); });
  });
}

void Connection::on_prepared(RouteResult result) {
  if (phase_ == Phase::closed || phase_ == Phase::lingering) {
    if (result.pending) result.pending->cancel();
    return;
  }
  if (result.response) {
    send_response(*result.response);
    return;
  }
  pending_ = std::move(result.pending);
  std::weak_ptr<Connection> weak = weak_from_this();
  auto posted = notify_posted_;
  auto executor = stream_.get_executor();
  pending_->set_notify([weak, posted, executor] {
    if (posted->exchange(true)) return;  // one wake-up at a time; on_progress drains everything
    net::post(executor, [weak, posted] {
      posted->store(false);
      if (auto self = weak.lock()) self->on_progress();
    });
  });
  arm_tick();
  on_progress();
}

void Connection::on_progress() {
  if (!pending_ || phase_ != Phase::processing) return;
  ResponsePart part = pending_->poll();
  if (part.full) {
    pending_.reset();
    send_response(*part.full);
    return;
  }
  if (part.stream_head) start_stream(*part.stream_head);
  if (!part.data.empty()) enqueue(http10_ ? std::move(part.data) : chunk(part.data));
  if (part.end) {
    pending_.reset();
    if (!http10_) enqueue("0\r\n\r\n");
    response_complete_ = true;
    if (!writing_) finish_response();
  }
}

void Connection::start_stream(const HttpResponse& head) {
  core_.metrics.count_request(endpoint_, head.status);
  streaming_ = true;
  if (http10_) close_after_ = true;  // no chunked encoding in HTTP/1.0: the body ends with the connection
  std::string h = status_line(head.status) + headers_text(head);
  h += http10_ ? "Connection: close\r\n\r\n" : "Transfer-Encoding: chunked\r\n" + connection_header(false);
  enqueue(std::move(h));
}

void Connection::send_response(const HttpResponse& r) {
  core_.metrics.count_request(endpoint_.empty() ? "other" : endpoint_, r.status);
  if (r.close || !keep_alive_ || limited_ || core_.draining) close_after_ = true;
  std::string bytes = status_line(r.status) + headers_text(r);
  bytes += fmt::format("Content-Length: {}\r\n", r.body.size()) + connection_header(close_after_);
  bytes += r.body;
  enqueue(std::move(bytes));
  response_complete_ = true;
  if (!writing_) finish_response();
}

// "Connection: ..." and, when the connection stays open, how long it stays idle (clients then retire it first
// instead of racing the server's close).
std::string Connection::connection_header(bool close) const {
  if (close) return "Connection: close\r\n\r\n";
  const auto idle_s = std::chrono::duration_cast<std::chrono::seconds>(core_.cfg.keep_alive_timeout).count();
  return fmt::format("Connection: keep-alive\r\nKeep-Alive: timeout={}\r\n\r\n", std::max<int64_t>(idle_s, 1));
}

void Connection::reject(int status, const std::string& message) {
  if (endpoint_.empty()) endpoint_ = "other";
  HttpResponse r = error_response(status, message);
  r.close = true;
  send_response(r);
}

// A read kept pending while a request is processed: EOF or an error means the client went away. Bytes that arrive
// (a pipelined next request) are kept for the parser.
void Connection::watch() {
  if (watching_ || reading_ || phase_ == Phase::closed || buffer_.size() >= kMaxPipelinedBytes) return;
  watching_ = true;
  stream_.async_read_some(buffer_.prepare(kReadChunk), [self = shared_from_this()](beast::error_code ec, size_t n) {
    self->on_watch(ec, n);
  });
}

// A deadline covers only reads started after it is set, so a pending watch read is cancelled and reissued.
void Connection::rearm_watch() {
  rearm_watch_ = true;
  beast::error_code ignored;
  stream_.socket().cancel(ignored);
}

void Connection::on_watch(beast::error_code ec, size_t n) {
  watching_ = false;
  if (phase_ == Phase::closed) return;
  if (rearm_watch_) {
    rearm_watch_ = false;
    if (!ec) buffer_.commit(n);
    if (phase_ == Phase::reading) {
      wait_for_request();
    } else {
      watch();
    }
    return;
  }
  if (phase_ == Phase::lingering) {
    if (ec) {
      close();
    } else {
      buffer_.consume(buffer_.size());
      watch();
    }
    return;
  }
  if (ec) {
    if (phase_ == Phase::reading) {
      close();  // idle between requests: the client closed the connection, or the keep-alive deadline passed
    } else {
      client_gone(ec == beast::error::timeout ? "a write to the client timed out" : "the client closed the connection");
    }
    return;
  }
  buffer_.commit(n);
  if (phase_ == Phase::reading) {
    read_header();
  } else {
    watch();
  }
}

void Connection::client_gone(const char* why) {
  if (pending_) {
    log::info("frontend: {} {}: {}; cancelling its generation", req_.method, req_.path, why);
  }
  close();
}

void Connection::enqueue(std::string bytes) {
  if (phase_ == Phase::closed || phase_ == Phase::lingering) return;
  out_.push_back(std::move(bytes));
  if (!writing_) write_next();
}

void Connection::write_next() {
  writing_ = true;
  stream_.expires_after(core_.cfg.write_timeout);
  net::async_write(stream_, net::buffer(out_.front()), [self = shared_from_this()](beast::error_code ec, size_t) {
    self->on_write(ec);
  });
}

void Connection::on_write(beast::error_code ec) {
  writing_ = false;
  if (phase_ == Phase::closed || phase_ == Phase::lingering) return;
  if (ec) {
    client_gone(ec == beast::error::timeout ? "a write to the client timed out" : "a write to the client failed");
    return;
  }
  out_.pop_front();
  last_write_ = Clock::now();
  if (!out_.empty()) {
    write_next();
    return;
  }
  if (response_complete_) {
    finish_response();
  } else if (phase_ == Phase::processing) {
    stream_.expires_never();  // waiting for the generation: only the watch read is pending
  } else if (reading_) {
    stream_.expires_after(core_.cfg.body_timeout);  // the 100 Continue went out while the body is read
  }
}

void Connection::finish_response() {
  if (writing_ || !out_.empty()) return;
  response_complete_ = false;
  streaming_ = false;
  tick_.cancel();
  if (counted_active_) {
    counted_active_ = false;
    --core_.n_active;
  }
  if (close_after_ || phase_ == Phase::closed) {
    linger_close();
    return;
  }
  first_request_ = false;
  wait_for_request();
}

void Connection::linger_close() {
  if (phase_ == Phase::closed || phase_ == Phase::lingering) return;
  if (pending_) {
    pending_->cancel();
    pending_.reset();
  }
  phase_ = Phase::lingering;
  beast::error_code ec;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
  if (ec) {
    close();
    return;
  }
  stream_.expires_after(kLingerTimeout);
  buffer_.consume(buffer_.size());
  if (watching_) {
    rearm_watch();
  } else {
    watch();
  }
}

void Connection::arm_tick() {
  tick_.expires_after(core_.cfg.stream_keep_alive);
  tick_.async_wait([self = shared_from_this()](beast::error_code ec) {
    if (!ec) self->on_tick();
  });
}

// Keeps an idle stream alive for proxies (an SSE comment after stream_keep_alive without data).
void Connection::on_tick() {
  if (!pending_ || phase_ != Phase::processing) return;
  if (streaming_ && out_.empty() && Clock::now() - last_write_ >= core_.cfg.stream_keep_alive) {
    std::string ka = pending_->keep_alive();
    if (!ka.empty()) enqueue(http10_ ? std::move(ka) : chunk(ka));
  }
  arm_tick();
}

void Connection::close() {
  if (phase_ == Phase::closed) return;
  phase_ = Phase::closed;
  tick_.cancel();
  if (pending_) {
    pending_->cancel();
    pending_.reset();
  }
  if (counted_active_) {
    counted_active_ = false;
    --core_.n_active;
  }
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
  stream_.close();
}

}  // namespace bg::frontend
