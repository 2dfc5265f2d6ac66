// PeerClient: requests as header-only active messages with a reply endpoint; replies land in the Pending their id
// names, their payload received straight into the caller's memory (rendezvous) only when its length is exactly the
// one asked for.
#include "weights/peer_client.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "weights/checksum.h"
#include "weights/ucx.h"

namespace bg::weights {

struct PeerClientCallbacks {
  static void on_error(void* arg, ucp_ep_h, ucs_status_t) { static_cast<PeerClient*>(arg)->ep_failed_ = true; }
  static void on_sent(void* request, ucs_status_t, void*) { ucp_request_free(request); }
  static void on_payload(void* request, ucs_status_t status, size_t, void* user_data) {
    auto* p = static_cast<PeerClient::Pending*>(user_data);
    if (status != UCS_OK) p->error = fmt::format("receiving the payload failed: {}", ucs_status_string(status));
    p->done = true;
    ucp_request_free(request);
  }
  static ucs_status_t drop(const ucp_am_recv_param_t* param) {
    return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ? UCS_ERR_MESSAGE_TRUNCATED : UCS_OK;
  }
  static ucs_status_t on_reply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param) {
    auto* c = static_cast<PeerClient*>(arg);
    PeerReply reply;
    if (header_length != sizeof(PeerReply)) return drop(param);
    std::memcpy(&reply, header, sizeof(reply));
    auto it = c->pending_.find(reply.id);
    if (reply.magic != kPeerMagic || it == c->pending_.end() || it->second.replied) return drop(param);
    PeerClient::Pending& p = it->second;
    p.reply = reply;
    p.replied = true;
    if (reply.ok == 0) {
      p.error = "refused: " + reply_error(reply);
      p.done = true;
      return drop(param);
    }
    const bool to_buffer = p.dst == nullptr;
    const bool length_ok = reply.bytes == length && (to_buffer ? length <= p.expected : length == p.expected);
    if (!length_ok) {
      p.error = fmt::format("sent {} bytes (declared {}) for a request of {}{} bytes", length, reply.bytes,
                            to_buffer ? "at most " : "", p.expected);
      p.done = true;
      return drop(param);
    }
    if (to_buffer) p.buffer.resize(length);
    std::byte* target = to_buffer ? p.buffer.data() : p.dst;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
      if (length > 0) std::memcpy(target, data, length);
      p.done = true;
      return UCS_OK;
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &on_payload;
    rp.user_data = &p;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(c->worker_->get(), data, target, length, &rp);
    if (r == nullptr) p.done = true;
    if (UCS_PTR_IS_ERR(r)) {
      p.error = fmt::format("receiving the payload failed: {}", ucs_status_string(UCS_PTR_STATUS(r)));
      p.done = true;
    }
    return UCS_INPROGRESS;  // the receive owns the data descriptor now
  }
};

namespace {

// A connection-level failure (peer not listening yet, connection lost): worth retrying while peers start.
class PeerConnectionError : public Error {
 public:
  using Error::Error;
};

}  // namespace

PeerClient::PeerClient(std::string node, std::string host, uint16_t port, const std::string& secret,
                       PeerClientOptions options)
    : node_(std::move(node)), host_(std::move(host)), port_(port), o_(options) {
  worker_ = std::make_unique<UcxWorker>(/*wakeup=*/false);
  worker_->set_am_handler(kPeerReplyId, &PeerClientCallbacks::on_reply, this);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(o_.connect_timeout_ms);
  for (int attempt = 1;; ++attempt) {
    ep_failed_ = false;
    pending_.clear();
    try {
      try {
        ep_ = ucx_connect(*worker_, host_, port_, &PeerClientCallbacks::on_error, this);
      } catch (const Error& e) {
        throw PeerConnectionError(what() + ": " + e.what());
      }
      handshake(secret);
      break;
    } catch (const PeerConnectionError& e) {
      ucx_close(*worker_, static_cast<ucp_ep_h>(ep_), 1000);
      ep_ = nullptr;
      if (std::chrono::steady_clock::now() > deadline) {
        fail("{} (gave up after {} attempts in {} ms)", e.what(), attempt, o_.connect_timeout_ms);
      }
      if (attempt == 1) log::info("{}; retrying (not reachable yet)", e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    } catch (...) {
      ucx_close(*worker_, static_cast<ucp_ep_h>(ep_), 1000);
      ep_ = nullptr;
      throw;
    }
  }
  log::info("{}: authenticated; it serves {} tensors ({} bytes)", what(), manifest_.tensors.size(),
            manifest_.total_bytes());
}

PeerClient::~PeerClient() {
  if (ep_ != nullptr) ucx_close(*worker_, static_cast<ucp_ep_h>(ep_), 1000);
  // Receives still in flight reference pending_: let UCX finish or cancel them before the map goes away.
  worker_->progress();
  worker_.reset();
}

std::string PeerClient::what() const { return fmt::format("weight peer {} ({}:{})", node_, host_, port_); }

uint64_t PeerClient::send(const PeerRequest& request, Pending pending) {
  const uint64_t id = next_id_++;
  auto [it, inserted] = pending_.emplace(id, std::move(pending));
  // The request header lives in a heap copy until UCX is done with it.
  auto req = std::make_shared<PeerRequest>(request);
  req->id = id;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t s = ucp_am_send_nbx(static_cast<ucp_ep_h>(ep_), kPeerRequestId, req.get(), sizeof(PeerRequest),
                                       nullptr, 0, &p);
  try {
    worker_->wait_request(s, o_.timeout_ms, what() + ": sending a request");
  } catch (const Error& e) {
    pending_.erase(it);
    throw PeerConnectionError(e.what());
  }
  return id;
}

PeerClient::Pending& PeerClient::wait(uint64_t id) {
  Pending& p = pending_.at(id);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(o_.timeout_ms);
  while (!p.done) {
    worker_->progress();
    if (ep_failed_) throw PeerConnectionError(what() + ": the connection failed or was lost");
    if (std::chrono::steady_clock::now() > deadline) fail("{}: no reply within {} ms", what(), o_.timeout_ms);
  }
  return p;
}

void PeerClient::handshake(const std::string& secret) {
  const auto key = key_bytes(secret);
  PeerRequest hello;
  hello.op = static_cast<uint32_t>(PeerOp::kHello);
  hello.nonce_or_mac = random_nonce();
  Pending& h = wait(send(hello, {}));
  BG_CHECK(h.error.empty(), "{}: {}", what(), h.error);
  const Digest nc = hello.nonce_or_mac, ns = h.reply.nonce;
  BG_CHECK(digest_equal(h.reply.mac, peer_mac(key, "bg-weights-v1 server", nc, ns)),
           "{}: failed authentication: it does not know the shared secret; refusing it", what());
  PeerRequest auth;
  auth.op = static_cast<uint32_t>(PeerOp::kAuth);
  auth.nonce_or_mac = peer_mac(key, "bg-weights-v1 client", nc, ns);
  Pending& a = wait(send(auth, {}));
  BG_CHECK(a.error.empty(), "{}: {}", what(), a.error);
  const Digest session = peer_mac(key, "bg-weights-v1 session", nc, ns);
  PeerRequest manifest;
  manifest.op = static_cast<uint32_t>(PeerOp::kManifest);
  Pending mp;
  mp.expected = kPeerMaxManifest;
  Pending& m = wait(send(manifest, std::move(mp)));
  BG_CHECK(m.error.empty(), "{}: manifest: {}", what(), m.error);
  BG_CHECK(digest_equal(m.reply.mac, peer_mac_bytes(key_bytes(session), m.buffer)),
           "{}: its manifest fails the session MAC; refusing it", what());
  manifest_ = decode_manifest(m.buffer, what() + " manifest");
  pending_.clear();
}

void PeerClient::read(uint32_t index, uint64_t offset, uint64_t bytes, std::byte* dst) {
  PeerRequest r;
  r.op = static_cast<uint32_t>(PeerOp::kRead);
  r.tensor = index;
  r.offset = offset;
  r.bytes = bytes;
  Pending p;
  p.dst = dst;
  p.expected = bytes;
  const uint64_t id = send(r, std::move(p));
  Pending& got = wait(id);
  const std::string error = got.error;
  pending_.erase(id);
  BG_CHECK(error.empty(), "{}: reading tensor {} [{}, +{}): {}", what(), index, offset, bytes, error);
  bytes_received_ += bytes;
}

void PeerClient::fetch(uint32_t index, std::byte* dst) {
  BG_CHECK(index < manifest_.tensors.size(), "{}: tensor {} of {}", what(), index, manifest_.tensors.size());
  const TensorInfo& t = manifest_.tensors[index];
  std::vector<uint64_t> in_flight;
  uint64_t next = 0;
  auto retire = [&] {
    const uint64_t id = in_flight.front();
    Pending& got = wait(id);  // when it throws, the chunk stays in flight for drain()
    in_flight.erase(in_flight.begin());
    const std::string error = got.error;
    const uint64_t bytes = got.expected;
    pending_.erase(id);
    BG_CHECK(error.empty(), "{}: fetching '{}': {}", what(), t.name, error);
    bytes_received_ += bytes;
  };
  // On an error, the chunks still in flight are given time to finish (a failed endpoint completes its receives with
  // an error status), so no receive writes into dst after the caller has given up on it. A chunk whose header arrived
  // but whose payload never completed stays in pending_: its receive still points at that entry.
  auto drain = [&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(o_.timeout_ms);
    for (uint64_t id : in_flight) {
      const Pending& p = pending_.at(id);
      while (!p.done && p.replied && std::chrono::steady_clock::now() < deadline) worker_->progress();
      if (p.done || !p.replied) {
        pending_.erase(id);
      } else {
        log::warn("{}: a payload of '{}' is still arriving after the fetch failed", what(), t.name);
      }
    }
    in_flight.clear();
  };
  try {
    while (next < t.bytes || !in_flight.empty()) {
      if (next < t.bytes && in_flight.size() < static_cast<size_t>(std::max(1, o_.max_in_flight))) {
        const uint64_t n = std::min(o_.chunk_bytes, t.bytes - next);
        PeerRequest r;
        r.op = static_cast<uint32_t>(PeerOp::kRead);
        r.tensor = index;
        r.offset = next;
        r.bytes = n;
        Pending p;
        p.dst = dst + next;
        p.expected = n;
        in_flight.push_back(send(r, std::move(p)));
        next += n;
        continue;
      }
      retire();
    }
  } catch (...) {
    drain();
    throw;
  }
  const uint64_t sum = xxh64({dst, t.bytes});
  BG_CHECK(sum == t.xxh64, "{}: tensor '{}' arrived with checksum {:#x}, its manifest says {:#x}; refusing it", what(),
           t.name, sum, t.xxh64);
}

}  // namespace bg::weights
