// Route table, header checks, the GET endpoints (health, ready, metrics, models) and the entry to the generation
// endpoints with their error mapping.
#include "server/frontend/routes.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>

#include "core/error.h"
#include "core/log.h"
#include "server/frontend/api_error.h"
#include "server/frontend/openai_handlers.h"

namespace bg::frontend {

using nlohmann::json;

namespace {

struct Route {
  std::string_view path;
  std::string_view method;
};
constexpr Route kRoutes[] = {{"/v1/chat/completions", "POST"}, {"/v1/completions", "POST"}, {"/v1/models", "GET"},
                             {"/health", "GET"},               {"/ready", "GET"},           {"/metrics", "GET"}};

bool is_probe(const std::string& path) { return path == "/health" || path == "/ready"; }

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// application/json, or any +json type; a charset other than utf-8 is refused.
bool json_content_type(std::string_view value) {
  const size_t semi = value.find(';');
  const std::string type = lower(trim(value.substr(0, semi)));
  const bool json_type = type == "application/json" || (type.size() > 5 && type.ends_with("+json"));
  if (!json_type) return false;
  std::string params = semi == std::string_view::npos ? "" : lower(value.substr(semi + 1));
  const size_t cs = params.find("charset=");
  if (cs == std::string::npos) return true;
  std::string charset(trim(std::string_view(params).substr(cs + 8)));
  charset = charset.substr(0, charset.find(';'));
  charset.erase(std::remove(charset.begin(), charset.end(), '"'), charset.end());
  return charset == "utf-8" || charset == "utf8";
}

bool bearer_matches(const HttpRequest& req, const std::string& key) {
  const std::string* auth = req.header("authorization");
  const std::string_view prefix = "Bearer ";
  if (auth == nullptr || auth->size() < prefix.size() || auth->compare(0, prefix.size(), prefix) != 0) return false;
  return constant_time_equal(std::string_view(*auth).substr(prefix.size()), key);
}

json rank_json(const RankState& s) {
  json j = {{"rank", s.rank},
            {"state", s.state()},
            {"phase", s.status.phase},
            {"pid", s.pid},
            {"process_alive", s.process_alive},
            {"connected", s.connected},
            {"ready", s.ready()},
            {"restarts", s.restarts},
            {"seconds_since_status", s.status_age_s}};
  if (s.node >= 0) j["node"] = s.node;
  if (!s.ready()) j["reason"] = s.not_ready_reason();
  return j;
}

HttpResponse json_response(int status, const json& body) {
  HttpResponse r;
  r.status = status;
  r.body = dump_json(body);
  return r;
}

}  // namespace

HttpResponse error_response(int status, const std::string& message, const std::string& param,
                            const std::string& code) {
  return json_response(status, error_body(status, message, param, code));
}

bool constant_time_equal(std::string_view given, std::string_view expected) {
  // Every byte of `given` is compared (against the key, cycled), so the time says nothing about where they differ.
  unsigned diff = given.size() == expected.size() ? 0u : 1u;
  for (size_t i = 0; i < given.size(); ++i) {
    const char e = expected.empty() ? '\0' : expected[i % expected.size()];
    diff |= static_cast<unsigned char>(given[i] ^ e);
  }
  return diff == 0 && !expected.empty();
}

std::string host_of(std::string_view host_header) {
  std::string_view h = trim(host_header);
  if (!h.empty() && h.front() == '[') {
    const size_t end = h.find(']');
    return lower(end == std::string_view::npos ? h.substr(1) : h.substr(1, end - 1));
  }
  const size_t colon = h.find(':');
  return lower(colon == std::string_view::npos ? h : h.substr(0, colon));
}

std::string endpoint_label(const std::string& path) {
  for (const Route& r : kRoutes) {
    if (path == r.path) return std::string(r.path);
  }
  return "other";
}

std::optional<HttpResponse> Router::check_head(const HttpRequest& req, const HeadInfo& info) const {
  // DNS rebinding: a browser tricked into calling this server sends the attacker's name as Host. The probes stay
  // reachable by address (orchestrators call them with the pod IP).
  if (!cfg_.allowed_hosts.empty() && !is_probe(req.path)) {
    const std::string* host = req.header("host");
    const std::string name = host == nullptr ? "" : host_of(*host);
    if (std::find(cfg_.allowed_hosts.begin(), cfg_.allowed_hosts.end(), name) == cfg_.allowed_hosts.end()) {
      return error_response(403, fmt::format("Host '{}' is not allowed (--allowed-hosts)", name), "", "host_not_allowed");
    }
  }
  std::string allow;
  for (const Route& r : kRoutes) {
    if (req.path != r.path) continue;
    if (req.method == r.method) {
      allow.clear();
      break;
    }
    allow = r.method;
  }
  if (!allow.empty()) {
    HttpResponse r = error_response(405, fmt::format("Method {} is not allowed on {}; use {}", req.method, req.path,
                                                     allow), "", "method_not_allowed");
    r.headers.emplace_back("Allow", allow);
    return r;
  }
  if (endpoint_label(req.path) == "other") {
    return error_response(404, fmt::format("Unknown route: {} {}", req.method, req.path), "", "unknown_route");
  }
  if (info.limited && !is_probe(req.path)) {
    HttpResponse r = error_response(503, "The server is at its connection limit (--max-connections); only /health "
                                         "and /ready are answered on extra connections", "", "too_many_connections");
    r.headers.emplace_back("Retry-After", "1");
    return r;
  }
  if (!cfg_.api_key.empty() && req.path.rfind("/v1/", 0) == 0 && !bearer_matches(req, cfg_.api_key)) {
    return error_response(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'", "",
                          "invalid_api_key");
  }
  if (req.method == "POST") {
    const std::string* type = req.header("content-type");
    if (type != nullptr && !json_content_type(*type)) {
      return error_response(415, fmt::format("Content-Type '{}' is not supported: send application/json (UTF-8)",
                                             *type), "", "unsupported_media_type");
    }
    const std::string* encoding = req.header("content-encoding");
    if (encoding != nullptr && lower(trim(*encoding)) != "identity") {
      return error_response(415, fmt::format("Content-Encoding '{}' is not supported: send the body uncompressed",
                                             *encoding), "", "unsupported_media_type");
    }
  }
  if (info.content_length && *info.content_length > cfg_.max_body_bytes) {
    return error_response(413, fmt::format("The request body is larger than the limit of {} bytes",
                                           cfg_.max_body_bytes), "", "request_too_large");
  }
  if (draining_ && is_generation(req)) {
    HttpResponse r = error_response(503, "The server is shutting down", "", "shutting_down");
    r.close = true;
    return r;
  }
  return std::nullopt;
}

HttpResponse Router::ready() const {
  json ranks = json::array();
  bool ready = !draining_;
  std::string why = draining_ ? "the server is shutting down" : "";
  for (const RankState& s : ctx_.link.ranks()) {
    ranks.push_back(rank_json(s));
    if (!s.ready()) {
      ready = false;
      if (why.empty()) why = fmt::format("{} is not ready: {}", s.name(), s.not_ready_reason());
    }
  }
  json body = {{"ready", ready}, {"ranks", std::move(ranks)}};
  if (!ready) body["reason"] = why;
  return json_response(ready ? 200 : 503, body);
}

HttpResponse Router::health() const {
  // Healthy while the frontend runs and the worker set is serving or being brought back by the supervisor; 503
  // once the supervisor has given up (a crash loop), which a liveness probe should escalate to a restart.
  json ranks = json::array();
  bool healthy = true;
  std::string why;
  for (const RankState& s : ctx_.link.ranks()) {
    ranks.push_back(rank_json(s));
    if (s.gave_up) {
      healthy = false;
      if (why.empty()) why = fmt::format("{}: {}", s.name(), s.not_ready_reason());
    }
  }
  json body = {{"status", healthy ? "ok" : "unhealthy"}, {"ranks", std::move(ranks)}};
  if (!healthy) body["reason"] = why;
  return json_response(healthy ? 200 : 503, body);
}

HttpResponse Router::handle_get(const HttpRequest& req) const {
  try {
    if (req.path == "/health") return health();
    if (req.path == "/ready") return ready();
    if (req.path == "/metrics") {
      HttpResponse r;
      r.content_type = "text/plain; version=0.0.4";
      r.body = ctx_.metrics.render(ctx_.link.ranks());
      return r;
    }
    if (req.path == "/v1/models") return json_response(200, models_body(ctx_));
  } catch (const std::exception& e) {
    log::error("frontend: {} {}: {}", req.method, req.path, e.what());
    return error_response(500, "internal server error (details are in the server log)");
  }
  return error_response(404, fmt::format("Unknown route: {} {}", req.method, req.path), "", "unknown_route");
}

RouteResult Router::handle_generation(const HttpRequest& req) const {
  RouteResult out;
  try {
    if (draining_) {
      out.response = error_response(503, "The server is shutting down", "", "shutting_down");
      out.response->close = true;
    } else if (req.path == "/v1/chat/completions") {
      out.pending = start_chat_completion(ctx_, req);
    } else if (req.path == "/v1/completions") {
      out.pending = start_completion(ctx_, req);
    } else {
      out.response = error_response(404, fmt::format("Unknown route: {} {}", req.method, req.path), "",
                                    "unknown_route");
    }
  } catch (const ApiError& e) {
    out.pending.reset();
    out.response = error_response(e.status(), e.what(), e.param(), e.code());
  } catch (const std::exception& e) {
    // Anything else is our bug: the client gets no internal text, the log gets all of it.
    log::error("frontend: {} {}: internal error: {}", req.method, req.path, e.what());
    out.pending.reset();
    out.response = error_response(500, "internal server error (details are in the server log)");
  }
  return out;
}

}  // namespace bg::frontend
