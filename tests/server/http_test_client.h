// A small blocking HTTP/1.1 client over POSIX sockets for the frontend tests: raw requests (any bytes, chunked
// uploads), responses with Content-Length or chunked bodies, a callback per received body piece that can hang up,
// and read timeouts. Not a general client: just enough to drive the server exactly.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace bg::testing {

struct HttpResult {
  int status = 0;                               // 0: no (complete) response
  std::map<std::string, std::string> headers;   // lower-case names
  std::string body;                             // de-chunked
  bool closed = false;                          // the server closed the connection after the response
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
};

class TestConnection {
 public:
  explicit TestConnection(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      close(fd_);
      fd_ = -1;
    }
    int one = 1;
    if (fd_ >= 0) setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  ~TestConnection() { hang_up(); }
  TestConnection(const TestConnection&) = delete;
  TestConnection& operator=(const TestConnection&) = delete;

  bool ok() const { return fd_ >= 0; }
  void hang_up() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  bool send_raw(const std::string& bytes) {
    size_t off = 0;
    while (fd_ >= 0 && off < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return fd_ >= 0;
  }
  // True when the server has closed the connection (EOF) within `wait_ms`.
  bool closed_by_server(int wait_ms) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, wait_ms) <= 0) return false;
    char c;
    return ::recv(fd_, &c, 1, MSG_PEEK) <= 0;
  }

  // Reads one response. on_body gets each piece of body as it arrives; returning false hangs up at once.
  HttpResult read_response(int timeout_ms = 10000,
                           const std::function<bool(const std::string&)>& on_body = nullptr) {
    HttpResult r;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    size_t header_end;
    while ((header_end = in_.find("\r\n\r\n")) == std::string::npos) {
      if (!fill(deadline)) return r;
    }
    std::string head = in_.substr(0, header_end);
    in_.erase(0, header_end + 4);
    if (head.rfind("HTTP/1.1 100", 0) == 0) return read_response(timeout_ms, on_body);  // interim response
    r.status = std::atoi(head.substr(9, 3).c_str());
    size_t pos = head.find("\r\n");
    while (pos != std::string::npos) {
      const size_t next = head.find("\r\n", pos + 2);
      const std::string line = head.substr(pos + 2, next == std::string::npos ? std::string::npos : next - pos - 2);
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        std::string k = line.substr(0, colon);
        std::transform(k.begin(), k.end(), k.begin(), [](unsigned char c) { return std::tolower(c); });
        r.headers[k] = line.substr(line.find_first_not_of(' ', colon + 1));
      }
      pos = next;
    }
    auto emit = [&](const std::string& piece) {
      r.body += piece;
      if (on_body && !on_body(piece)) {
        hang_up();
        return false;
      }
      return true;
    };
    if (r.header("transfer-encoding") == "chunked") {
      for (;;) {
        size_t eol;
        while ((eol = in_.find("\r\n")) == std::string::npos) {
          if (!fill(deadline)) return incomplete(r);
        }
        const size_t n = std::stoul(in_.substr(0, eol), nullptr, 16);
        while (in_.size() < eol + 2 + n + 2) {
          if (!fill(deadline)) return incomplete(r);
        }
        const std::string piece = in_.substr(eol + 2, n);
        in_.erase(0, eol + 2 + n + 2);
        if (n == 0) break;
        if (!emit(piece)) return r;
      }
    } else {
      const size_t n = std::stoul(r.header("content-length").empty() ? "0" : r.header("content-length"));
      while (in_.size() < n) {
        if (!fill(deadline)) return incomplete(r);
      }
      if (!emit(in_.substr(0, n))) return r;
      in_.erase(0, n);
    }
    r.closed = r.header("connection") == "close";
    return r;
  }

 private:
  static HttpResult incomplete(HttpResult r) {
    r.status = 0;
    return r;
  }
  bool fill(std::chrono::steady_clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                            std::chrono::steady_clock::now());
    if (fd_ < 0 || left.count() <= 0) return false;
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
    char buf[16384];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n <= 0) return false;
    in_.append(buf, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  std::string in_;
};

// One request on a new connection. headers: extra "Name: value" pairs. A body gets Content-Length unless a
// Transfer-Encoding header is given (then `body` is sent as is).
inline HttpResult http_request(int port, const std::string& method, const std::string& path, const std::string& body,
                               const std::vector<std::pair<std::string, std::string>>& headers = {},
                               int timeout_ms = 10000,
                               const std::function<bool(const std::string&)>& on_body = nullptr) {
  TestConnection c(port);
  if (!c.ok()) return {};
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n";
  bool has_type = false, has_te = false;
  for (const auto& [k, v] : headers) {
    req += k + ": " + v + "\r\n";
    has_type = has_type || k == "Content-Type";
    has_te = has_te || k == "Transfer-Encoding";
  }
  if (method == "POST" && !has_type) req += "Content-Type: application/json\r\n";
  if (!has_te && (method == "POST" || !body.empty())) req += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  req += "\r\n" + body;
  c.send_raw(req);
  return c.read_response(timeout_ms, on_body);
}

}  // namespace bg::testing
