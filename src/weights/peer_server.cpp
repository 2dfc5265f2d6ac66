// PeerServer: one thread drives a UCX worker; the active-message callback only queues requests, the loop answers them
// (never from inside a UCX callback). Replies carry their header in a heap box freed on send completion.
#include "weights/peer_server.h"

#include <cstring>
#include <deque>
#include <future>
#include <map>

#include "core/error.h"
#include "core/log.h"
#include "weights/peer_wire.h"
#include "weights/ucx.h"

namespace bg::weights {

StoreCatalog::StoreCatalog(const Manifest& m, std::vector<const std::byte*> segment_bases)
    : m_(m), bases_(std::move(segment_bases)), encoded_(encode_manifest(m)) {
  BG_CHECK(bases_.size() == m_.segments.size(), "store catalog: {} segment bases for {} segments", bases_.size(),
           m_.segments.size());
  // Peers are served tensors as the checkpoint holds them; a packed part has no stored bytes to serve.
  BG_CHECK(m_.packed.empty(), "a store holding W4A16 expert blocks cannot serve peers yet (--expert-layout w4a16 "
           "is not supported with a distributed config)");
}

std::span<const std::byte> StoreCatalog::read(uint32_t index, uint64_t offset, uint64_t bytes) const {
  const TensorInfo& t = m_.tensors.at(index);
  return {bases_[t.segment] + t.offset + offset, bytes};
}

struct PeerServer::Impl {
  struct Session {
    Digest nc{}, ns{}, key{};
    bool hello = false;
    bool authed = false;
  };
  struct Request {
    ucp_ep_h ep = nullptr;
    PeerRequest req;
  };

  PeerServerOptions o;
  std::shared_ptr<const PeerCatalog> catalog;
  PeerServer* owner = nullptr;
  std::unique_ptr<UcxWorker> worker;
  std::unique_ptr<UcxListener> listener;
  std::map<ucp_ep_h, Session> sessions;
  std::deque<Request> queue;
  std::vector<ucp_ep_h> dead;

  static void on_conn(ucp_conn_request_h request, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    if (self->sessions.size() >= self->o.max_sessions) {
      ucp_listener_reject(self->listener->get(), request);
      self->owner->n_refused_++;
      return;
    }
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.conn_request = request;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &Impl::on_error;
    p.err_handler.arg = self;
    ucp_ep_h ep = nullptr;
    if (ucp_ep_create(self->worker->get(), &p, &ep) == UCS_OK) self->sessions[ep] = {};
  }
  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t) { static_cast<Impl*>(arg)->dead.push_back(ep); }
  // Requests are headers only, sent with a reply endpoint; anything else is counted and dropped.
  static ucs_status_t on_request(void* arg, const void* header, size_t header_length, void*, size_t length,
                                 const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    Request r;
    const bool has_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0;
    if (header_length == sizeof(PeerRequest)) std::memcpy(&r.req, header, sizeof(PeerRequest));
    if (header_length != sizeof(PeerRequest) || length != 0 || !has_ep || r.req.magic != kPeerMagic) {
      self->owner->n_refused_++;
      return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    r.ep = param->reply_ep;
    self->queue.push_back(r);
    return UCS_OK;
  }
  static void on_sent(void* request, ucs_status_t, void* user_data) {
    delete static_cast<PeerReply*>(user_data);
    ucp_request_free(request);
  }

  void send(ucp_ep_h ep, const PeerReply& reply, std::span<const std::byte> data) {
    auto* box = new PeerReply(reply);
    box->bytes = data.size();
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &Impl::on_sent;
    p.user_data = box;
    ucs_status_ptr_t s = ucp_am_send_nbx(ep, kPeerReplyId, box, sizeof(*box), data.data(), data.size(), &p);
    if (s == nullptr || UCS_PTR_IS_ERR(s)) delete box;
    if (UCS_PTR_IS_ERR(s)) log::warn("weight peer server: reply failed: {}", ucs_status_string(UCS_PTR_STATUS(s)));
    if (!UCS_PTR_IS_ERR(s)) owner->bytes_served_ += data.size();
  }
  void refuse(ucp_ep_h ep, PeerReply& reply, const std::string& why) {
    owner->n_refused_++;
    log::warn("weight peer server: refused a request: {}", why);
    set_error(reply, why);
    send(ep, reply, {});
  }

  void handle(const Request& r) {
    Session& s = sessions[r.ep];
    PeerReply reply;
    reply.id = r.req.id;
    const std::span<const uint8_t> secret = key_bytes(o.secret);
    switch (static_cast<PeerOp>(r.req.op)) {
      case PeerOp::kHello:
        s = Session{};
        s.nc = r.req.nonce_or_mac;
        s.ns = random_nonce();
        s.hello = true;
        reply.ok = 1;
        reply.nonce = s.ns;
        reply.mac = peer_mac(secret, "bg-weights-v1 server", s.nc, s.ns);
        return send(r.ep, reply, {});
      case PeerOp::kAuth:
        if (!s.hello || !digest_equal(r.req.nonce_or_mac, peer_mac(secret, "bg-weights-v1 client", s.nc, s.ns))) {
          s = Session{};
          return refuse(r.ep, reply, "authentication failed (wrong shared secret?)");
        }
        s.authed = true;
        s.key = peer_mac(secret, "bg-weights-v1 session", s.nc, s.ns);
        reply.ok = 1;
        return send(r.ep, reply, {});
      case PeerOp::kManifest:
        if (!s.authed) return refuse(r.ep, reply, "not authenticated");
        reply.ok = 1;
        reply.mac = peer_mac_bytes(key_bytes(s.key), catalog->manifest_bytes());
        return send(r.ep, reply, catalog->manifest_bytes());
      case PeerOp::kRead: {
        if (!s.authed) return refuse(r.ep, reply, "not authenticated");
        const PeerRequest& q = r.req;
        if (q.tensor >= catalog->n_tensors()) {
          return refuse(r.ep, reply, fmt::format("tensor {} does not exist ({} tensors)", q.tensor,
                                                 catalog->n_tensors()));
        }
        const uint64_t size = catalog->tensor_bytes(q.tensor);
        if (q.offset > size || q.bytes > size - q.offset || q.bytes > kPeerMaxRead) {
          return refuse(r.ep, reply, fmt::format("read [{}, +{}) is outside tensor {} of {} bytes (or over {})",
                                                 q.offset, q.bytes, q.tensor, size, kPeerMaxRead));
        }
        reply.ok = 1;
        return send(r.ep, reply, catalog->read(q.tensor, q.offset, q.bytes));
      }
    }
    refuse(r.ep, reply, fmt::format("unknown operation {}", r.req.op));
  }

  void loop(const std::atomic<bool>& stop) {
    while (!stop) {
      worker->progress();
      for (ucp_ep_h ep : dead) {
        sessions.erase(ep);
        ucx_close(*worker, ep, 100);
      }
      dead.clear();
      while (!queue.empty()) {
        const Request r = queue.front();
        queue.pop_front();
        if (sessions.count(r.ep) != 0 || static_cast<PeerOp>(r.req.op) == PeerOp::kHello) handle(r);
      }
      worker->wait(50);
    }
    for (auto& [ep, s] : sessions) ucx_close(*worker, ep, 1000);
    sessions.clear();
    listener.reset();
    worker.reset();
  }
};

PeerServer::PeerServer(PeerServerOptions options, std::shared_ptr<const PeerCatalog> catalog)
    : impl_(std::make_unique<Impl>()) {
  BG_CHECK(!options.secret.empty(), "weight peer server: no shared secret");
  impl_->o = std::move(options);
  impl_->catalog = std::move(catalog);
  impl_->owner = this;
  std::promise<uint16_t> started;
  auto ready = started.get_future();
  thread_ = std::thread([this, &started] {
    try {
      impl_->worker = std::make_unique<UcxWorker>(/*wakeup=*/true);
      impl_->worker->set_am_handler(kPeerRequestId, &Impl::on_request, impl_.get());
      impl_->listener =
          std::make_unique<UcxListener>(*impl_->worker, impl_->o.host, impl_->o.port, &Impl::on_conn, impl_.get());
      started.set_value(impl_->listener->port());
    } catch (...) {
      impl_->listener.reset();
      impl_->worker.reset();
      started.set_exception(std::current_exception());
      return;
    }
    impl_->loop(stop_);
  });
  try {
    port_ = ready.get();
  } catch (...) {
    thread_.join();
    throw;
  }
  log::info("weight peer server listening on {}:{}", impl_->o.host, port_);
}

PeerServer::~PeerServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

}  // namespace bg::weights
