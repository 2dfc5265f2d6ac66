// The HTTP frontend: cpp-httplib server with a handler thread pool, routes (OpenAI API, /health, /ready, /metrics),
// the optional API key, the body size limit, OpenAI-style errors for every failure and request counting.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <string>

#include "server/frontend/generation.h"

namespace bg::frontend {

struct FrontendConfig {
  std::string served_model_name;
  std::string api_key;                          // "" = no authentication
  size_t max_body_bytes = size_t{16} << 20;     // larger bodies get 413
  size_t n_http_threads = 64;                   // each streaming response holds one for its duration
};

class FrontendServer {
 public:
  FrontendServer(FrontendConfig cfg, const TextModel& model, WorkerLink& link, Metrics& metrics);
  FrontendServer(const FrontendServer&) = delete;
  FrontendServer& operator=(const FrontendServer&) = delete;

  // Binds host:port (port 0: any free port); returns the port. Throws bg::Error when the address is unusable.
  int bind(const std::string& host, int port);
  // Serves until stop(); returns false if the server failed.
  bool listen();
  void stop();

 private:
  void install_routes();
  void handle_ready(httplib::Response& res) const;
  void handle_health(httplib::Response& res) const;

  FrontendConfig cfg_;
  ServingContext ctx_;
  httplib::Server svr_;
};

// The endpoint label for request metrics: known routes as they are, everything else "other".
std::string endpoint_label(const std::string& path);

}  // namespace bg::frontend
