// The HTTP layer's plain types, shared by the connection code (Boost.Beast, compiled only in http_server.cpp and
// http_connection.cpp) and the routes/handlers (no Boost): a parsed request, a response, and a response that is
// produced over time (a generation).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bg::frontend {

struct HttpRequest {
  std::string method;                                        // "GET", "POST", ...
  std::string target;                                        // as sent ("/v1/models?x=1")
  std::string path;                                          // the target without its query
  std::vector<std::pair<std::string, std::string>> headers;  // names in lower case, in arrival order
  std::string body;
  std::chrono::steady_clock::time_point arrival;

  // The first header of that (lower-case) name, or null.
  const std::string* header(std::string_view name) const {
    for (const auto& [k, v] : headers) {
      if (k == name) return &v;
    }
    return nullptr;
  }
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers (Allow, Cache-Control, ...)
  bool close = false;                                        // Connection: close after this response
};

// What a PendingResponse has for the connection right now.
struct ResponsePart {
  std::optional<HttpResponse> full;          // the whole response (non-streamed, or an error before a stream began)
  std::optional<HttpResponse> stream_head;   // starts a streamed (chunked) body with this status and headers
  std::string data;                          // stream bytes to send
  bool end = false;                          // the stream is complete after `data`
};

// A response produced over time. poll(), keep_alive() and cancel() are called on the connection's strand only;
// the notifier may be called from any thread.
class PendingResponse {
 public:
  virtual ~PendingResponse() = default;
  // `notify` is called whenever poll() may have something new (it must be cheap and must not block).
  virtual void set_notify(std::function<void()> notify) = 0;
  virtual ResponsePart poll() = 0;
  // Bytes that keep an idle stream alive (an SSE comment); "" when the response sends none.
  virtual std::string keep_alive() const = 0;
  // The client went away (or the server is stopping): stop the work now.
  virtual void cancel() = 0;
};

// What a route answers: a response now, or one that follows.
struct RouteResult {
  std::optional<HttpResponse> response;
  std::unique_ptr<PendingResponse> pending;
};

}  // namespace bg::frontend
