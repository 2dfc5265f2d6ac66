// Routes, authentication, error mapping and the server lifecycle.
#include "server/frontend/http_server.h"

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"
#include "server/frontend/api_error.h"
#include "server/frontend/openai_handlers.h"

namespace bg::frontend {

using nlohmann::json;

namespace {

void respond_error(httplib::Response& res, int status, const std::string& message, const std::string& param = "",
                   const std::string& code = "") {
  res.status = status;
  res.set_content(dump_json(error_body(status, message, param, code)), "application/json");
}

using EndpointFn = void (*)(ServingContext&, const httplib::Request&, httplib::Response&);

// Runs an endpoint; every exception becomes an OpenAI error body with the right status.
httplib::Server::Handler guarded(ServingContext& ctx, EndpointFn fn) {
  return [&ctx, fn](const httplib::Request& req, httplib::Response& res) {
    try {
      fn(ctx, req, res);
    } catch (const ApiError& e) {
      respond_error(res, e.status(), e.what(), e.param(), e.code());
    } catch (const std::exception& e) {
      log::error("frontend: {} {}: {}", req.method, req.path, e.what());
      respond_error(res, 500, fmt::format("internal error: {}", e.what()));
    }
  };
}

json rank_json(const RankState& s) {
  json j = {{"rank", s.rank},
            {"phase", s.status.phase},
            {"process_alive", s.process_alive},
            {"connected", s.connected},
            {"ready", s.ready()},
            {"seconds_since_status", s.status_age_s}};
  if (!s.ready()) j["reason"] = s.not_ready_reason();
  return j;
}

bool bearer_matches(const httplib::Request& req, const std::string& key) {
  const std::string auth = req.get_header_value("Authorization");
  const std::string prefix = "Bearer ";
  return auth.size() == prefix.size() + key.size() && auth.compare(0, prefix.size(), prefix) == 0 &&
         auth.compare(prefix.size(), std::string::npos, key) == 0;
}

}  // namespace

std::string endpoint_label(const std::string& path) {
  static const char* kKnown[] = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready",
                                 "/metrics"};
  for (const char* k : kKnown) {
    if (path == k) return k;
  }
  return "other";
}

FrontendServer::FrontendServer(FrontendConfig cfg, const TextModel& model, WorkerLink& link, Metrics& metrics)
    : cfg_(std::move(cfg)), ctx_{model, link, metrics, cfg_.served_model_name} {
  const size_t n = cfg_.n_http_threads;
  svr_.new_task_queue = [n] { return new httplib::ThreadPool(n); };
  svr_.set_payload_max_length(cfg_.max_body_bytes);
  svr_.set_keep_alive_max_count(1000);
  svr_.set_tcp_nodelay(true);
  install_routes();
}

void FrontendServer::handle_ready(httplib::Response& res) const {
  json ranks = json::array();
  bool ready = true;
  std::string why;
  for (const RankState& s : ctx_.link.ranks()) {
    ranks.push_back(rank_json(s));
    if (!s.ready()) {
      ready = false;
      if (why.empty()) why = fmt::format("rank {} is not ready: {}", s.rank, s.not_ready_reason());
    }
  }
  json body = {{"ready", ready}, {"ranks", std::move(ranks)}};
  if (!ready) body["reason"] = why;
  res.status = ready ? 200 : 503;
  res.set_content(dump_json(body), "application/json");
}

void FrontendServer::handle_health(httplib::Response& res) const {
  json ranks = json::array();
  bool alive = true;
  for (const RankState& s : ctx_.link.ranks()) {
    ranks.push_back(rank_json(s));
    alive = alive && s.process_alive;
  }
  res.status = alive ? 200 : 503;
  res.set_content(dump_json(json{{"status", alive ? "ok" : "unhealthy"}, {"ranks", std::move(ranks)}}),
                  "application/json");
}

void FrontendServer::install_routes() {
  svr_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (cfg_.api_key.empty() || req.path.rfind("/v1/", 0) != 0 || bearer_matches(req, cfg_.api_key)) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    respond_error(res, 401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'", "",
                  "invalid_api_key");
    return httplib::Server::HandlerResponse::Handled;
  });
  svr_.Post("/v1/chat/completions", guarded(ctx_, handle_chat_completions));
  svr_.Post("/v1/completions", guarded(ctx_, handle_completions));
  svr_.Get("/v1/models", guarded(ctx_, handle_models));
  svr_.Get("/health", [this](const httplib::Request&, httplib::Response& res) { handle_health(res); });
  svr_.Get("/ready", [this](const httplib::Request&, httplib::Response& res) { handle_ready(res); });
  svr_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(ctx_.metrics.render(ctx_.link.statuses()), "text/plain; version=0.0.4");
  });
  // Statuses set by httplib itself (unknown route, body too large, unreadable request) get an OpenAI body too.
  svr_.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404) {
      respond_error(res, 404, fmt::format("Unknown route: {} {}", req.method, req.path), "", "unknown_route");
    } else if (res.status == 413) {
      respond_error(res, 413, fmt::format("The request body is larger than the limit of {} bytes",
                                          cfg_.max_body_bytes), "", "request_too_large");
    } else {
      respond_error(res, res.status, fmt::format("HTTP error {}", res.status));
    }
  });
  svr_.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    log::error("frontend: {} {}: {}", req.method, req.path, what);
    respond_error(res, 500, "internal error: " + what);
  });
  svr_.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    ctx_.metrics.count_request(endpoint_label(req.path), res.status);
  });
}

int FrontendServer::bind(const std::string& host, int port) {
  if (port == 0) {
    const int bound = svr_.bind_to_any_port(host);
    BG_CHECK(bound > 0, "cannot listen on {} (any port)", host);
    return bound;
  }
  BG_CHECK(svr_.bind_to_port(host, port), "cannot listen on {}:{} (address in use or not available)", host, port);
  return port;
}

bool FrontendServer::listen() { return svr_.listen_after_bind(); }

void FrontendServer::stop() { svr_.stop(); }

}  // namespace bg::frontend
