// The HTTP frontend: an event-driven HTTP/1.1 server (Boost.Beast on Asio, kept out of this header) with a few I/O
// threads for every connection and a small pool that parses, tokenizes and submits generation requests. Deadlines
// for headers, bodies, idle keep-alive and writes; a connection cap with a reserve that only answers /health and
// /ready; client disconnects noticed from the socket; graceful drain.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "server/frontend/generation.h"

namespace bg::frontend {

struct FrontendConfig {
  std::string served_model_name;
  std::string api_key;                              // "" = no authentication
  std::vector<std::string> allowed_hosts;           // empty: any Host header (lower-case names)
  bool strict_params = false;                       // unknown request fields are a 400
  size_t max_body_bytes = size_t{16} << 20;         // larger bodies (any transfer encoding) get 413
  size_t max_header_bytes = size_t{64} << 10;       // larger headers get 431
  size_t max_connections = 4096;                    // open client connections served fully
  size_t reserve_connections = 64;                  // beyond the cap: only /health and /ready, then closed
  std::chrono::milliseconds header_timeout{10'000}; // a request header must be complete this long after it starts
  std::chrono::milliseconds reserve_header_timeout{2'000};  // the same, for a connection in the reserve
  std::chrono::milliseconds keep_alive_timeout{5'000};  // an idle connection between requests is closed after this
  std::chrono::milliseconds body_timeout{60'000};   // a request body must arrive within this
  std::chrono::milliseconds write_timeout{60'000};  // one write to a client that does not read fails after this
  std::chrono::milliseconds stream_keep_alive{1'000};   // an SSE comment after this long without data
  size_t n_io_threads = 2;                          // threads running every connection's I/O
  size_t n_prep_threads = 4;                        // threads parsing, rendering and tokenizing requests
};

class FrontendServer {
 public:
  FrontendServer(FrontendConfig cfg, const TextModel& model, WorkerLink& link, Metrics& metrics);
  ~FrontendServer();
  FrontendServer(const FrontendServer&) = delete;
  FrontendServer& operator=(const FrontendServer&) = delete;

  // Binds host:port (port 0: any free port; no SO_REUSEPORT, so a port in use is an error) and returns the port.
  // Throws bg::Error with a message for the user.
  int bind(const std::string& host, int port);
  // Starts the I/O and preparation threads; returns at once.
  void start();
  // start(), then blocks until stop() (tests run this on a thread). Returns true.
  bool listen();
  // Stops accepting connections, closes idle ones; requests already read are answered, new generation requests
  // get 503 and /ready reports the shutdown.
  void begin_drain();
  // Generation requests read and not yet fully answered.
  size_t active_requests() const;
  // Connections open beyond --max-connections, in the reserve that answers only /health and /ready.
  size_t reserve_connections_open() const;
  // Closes every connection (cancelling their generations) and joins the threads.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bg::frontend
