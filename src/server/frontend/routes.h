// The routes of the frontend and the checks every request passes before its body is read: Host (--allowed-hosts),
// route and method (404, 405 with Allow), the connection reserve beyond --max-connections (only /health and /ready),
// the API key (constant-time), Content-Type / Content-Encoding (415), the body limit (413) and draining (503).
// No I/O: the connection code (http_connection.cpp) calls these.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/frontend/generation.h"
#include "server/frontend/http_types.h"

namespace bg::frontend {

struct RouteConfig {
  std::string api_key;                       // "": no authentication
  std::vector<std::string> allowed_hosts;    // empty: any Host header
  size_t max_body_bytes = size_t{16} << 20;
};

// What the connection knows after the header.
struct HeadInfo {
  bool limited = false;                      // a connection beyond --max-connections (health checks only)
  std::optional<uint64_t> content_length;
  bool chunked = false;
};

class Router {
 public:
  Router(RouteConfig cfg, ServingContext& ctx) : cfg_(std::move(cfg)), ctx_(ctx) {}

  // A response when the request is refused on its header alone (the body is then not read).
  std::optional<HttpResponse> check_head(const HttpRequest& head, const HeadInfo& info) const;
  // Routes whose work (parse, tokenize, submit) runs on the preparation pool, not on the I/O threads.
  static bool is_generation(const HttpRequest& req) { return req.method == "POST"; }
  // GET routes (health, ready, metrics, models): answered at once.
  HttpResponse handle_get(const HttpRequest& req) const;
  // POST routes: parse, tokenize and submit; never throws (errors become responses).
  RouteResult handle_generation(const HttpRequest& req) const;

  // From now on generation requests get 503 and /ready reports the shutdown.
  void set_draining() { draining_ = true; }
  bool draining() const { return draining_; }

 private:
  HttpResponse ready() const;
  HttpResponse health() const;

  RouteConfig cfg_;
  ServingContext& ctx_;
  std::atomic<bool> draining_{false};
};

// The endpoint label for request metrics: known routes as they are, everything else "other".
std::string endpoint_label(const std::string& path);
// An OpenAI error body as a response.
HttpResponse error_response(int status, const std::string& message, const std::string& param = "",
                            const std::string& code = "");
// Equal strings, in time that depends only on the length of `given` (the API key check).
bool constant_time_equal(std::string_view given, std::string_view expected);
// The host part of a Host header ("example.com:8000" -> "example.com", "[::1]:80" -> "::1"), lower case.
std::string host_of(std::string_view host_header);

}  // namespace bg::frontend
