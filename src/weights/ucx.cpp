// UcxWorker, endpoints and the listener: status codes become bg::Error with UCX's own message.
#include "weights/ucx.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>

#include "core/error.h"

namespace bg::weights {
namespace {

void check(ucs_status_t s, const char* what) {
  BG_CHECK(s == UCS_OK, "UCX {}: {}", what, ucs_status_string(s));
}

// host:port -> a socket address (the first getaddrinfo answer).
sockaddr_storage resolve(const std::string& host, uint16_t port, socklen_t* len, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int err = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  BG_CHECK(err == 0 && res != nullptr, "cannot resolve {}:{}: {}", host, port, ::gai_strerror(err));
  sockaddr_storage out{};
  std::memcpy(&out, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return out;
}

}  // namespace

UcxWorker::UcxWorker(bool wakeup) {
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | (wakeup ? UCP_FEATURE_WAKEUP : 0);
  ucp_config_t* config = nullptr;
  check(ucp_config_read(nullptr, nullptr, &config), "config");
  const ucs_status_t s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  check(s, "init");
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (const ucs_status_t ws = ucp_worker_create(context_, &wp, &worker_); ws != UCS_OK) {
    ucp_cleanup(context_);
    check(ws, "worker");
  }
  if (wakeup) check(ucp_worker_get_efd(worker_, &efd_), "event fd");
}

UcxWorker::~UcxWorker() {
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

void UcxWorker::progress() {
  while (ucp_worker_progress(worker_) != 0) {
  }
}

void UcxWorker::wait(int timeout_ms) {
  progress();
  if (efd_ < 0) return;
  if (ucp_worker_arm(worker_) != UCS_OK) return;  // UCS_ERR_BUSY: events are pending, progress again
  pollfd p{efd_, POLLIN, 0};
  ::poll(&p, 1, timeout_ms);
}

void UcxWorker::set_am_handler(unsigned id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                 UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  p.id = id;
  p.cb = cb;
  p.arg = arg;
  p.flags = UCP_AM_FLAG_WHOLE_MSG;
  check(ucp_worker_set_am_recv_handler(worker_, &p), "set active-message handler");
}

void UcxWorker::wait_request(ucs_status_ptr_t request, int timeout_ms, const std::string& what) {
  if (request == nullptr) return;
  BG_CHECK(!UCS_PTR_IS_ERR(request), "{}: {}", what, ucs_status_string(UCS_PTR_STATUS(request)));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  ucs_status_t s = UCS_INPROGRESS;
  while ((s = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    progress();
    if (std::chrono::steady_clock::now() > deadline) {
      ucp_request_cancel(worker_, request);
      while (ucp_request_check_status(request) == UCS_INPROGRESS) progress();
      ucp_request_free(request);
      fail("{}: timed out after {} ms", what, timeout_ms);
    }
  }
  ucp_request_free(request);
  BG_CHECK(s == UCS_OK, "{}: {}", what, ucs_status_string(s));
}

ucp_ep_h ucx_connect(UcxWorker& w, const std::string& host, uint16_t port, UcxErrorCallback on_error, void* arg) {
  socklen_t len = 0;
  sockaddr_storage addr = resolve(host, port, &len, /*passive=*/false);
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  p.sockaddr.addrlen = len;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = on_error;
  p.err_handler.arg = arg;
  ucp_ep_h ep = nullptr;
  const ucs_status_t s = ucp_ep_create(w.get(), &p, &ep);
  BG_CHECK(s == UCS_OK, "cannot connect to weight peer {}:{}: {}", host, port, ucs_status_string(s));
  return ep;
}

void ucx_close(UcxWorker& w, ucp_ep_h ep, int timeout_ms) {
  if (ep == nullptr) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (ucp_request_check_status(r) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) w.progress();
  ucp_request_free(r);
}

UcxListener::UcxListener(UcxWorker& w, const std::string& host, uint16_t port, ConnHandler handler, void* arg) {
  socklen_t len = 0;
  sockaddr_storage addr = resolve(host, port, &len, /*passive=*/true);
  ucp_listener_params_t p{};
  p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  p.sockaddr.addrlen = len;
  p.conn_handler.cb = handler;
  p.conn_handler.arg = arg;
  const ucs_status_t s = ucp_listener_create(w.get(), &p, &listener_);
  BG_CHECK(s == UCS_OK, "cannot listen for weight peers on {}:{}: {}", host, port, ucs_status_string(s));
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  check(ucp_listener_query(listener_, &attr), "listener query");
  port_ = attr.sockaddr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6*>(&attr.sockaddr)->sin6_port)
                                              : ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
}

UcxListener::~UcxListener() { ucp_listener_destroy(listener_); }

}  // namespace bg::weights
