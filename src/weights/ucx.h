// Thin RAII over UCX's UCP API for the weight peers: a context + worker (one thread drives it), active-message
// handlers, client endpoints by host:port (UCX picks RDMA where present, shared memory or TCP otherwise) and a
// listener. Only what peer_server / peer_client need.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>

namespace bg::weights {

class UcxWorker {
 public:
  // wakeup: the worker gets an event fd so an idle server thread can sleep in wait().
  explicit UcxWorker(bool wakeup);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  ucp_worker_h get() const { return worker_; }
  // Progresses until there is nothing more to do right now.
  void progress();
  // Sleeps until there is network activity or `timeout_ms` passed (wakeup workers only).
  void wait(int timeout_ms);
  void set_am_handler(unsigned id, ucp_am_recv_callback_t cb, void* arg);
  // Waits for a non-blocking operation's result (nullptr: done at once); frees the request. Throws on error or when
  // `timeout_ms` passes (then the request is cancelled).
  void wait_request(ucs_status_ptr_t request, int timeout_ms, const std::string& what);

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
};

// Endpoint error callback signature (the peer went away).
using UcxErrorCallback = void (*)(void* arg, ucp_ep_h ep, ucs_status_t status);

// Connects to host:port (a numeric address or a name); the connection completes during progress.
ucp_ep_h ucx_connect(UcxWorker& w, const std::string& host, uint16_t port, UcxErrorCallback on_error, void* arg);
// Closes an endpoint (flushes, or forces after `timeout_ms`).
void ucx_close(UcxWorker& w, ucp_ep_h ep, int timeout_ms);

class UcxListener {
 public:
  using ConnHandler = void (*)(ucp_conn_request_h request, void* arg);
  // Listens on host:port (port 0: any; see port()).
  UcxListener(UcxWorker& w, const std::string& host, uint16_t port, ConnHandler handler, void* arg);
  ~UcxListener();
  UcxListener(const UcxListener&) = delete;
  UcxListener& operator=(const UcxListener&) = delete;
  uint16_t port() const { return port_; }
  ucp_listener_h get() const { return listener_; }

 private:
  ucp_listener_h listener_ = nullptr;
  uint16_t port_ = 0;
};

}  // namespace bg::weights
