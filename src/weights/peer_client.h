// The fetching side of the weight peers (a daemon with --fetch-missing, or an engine with
// --distributed-weight-config): connect, authenticate the server (and be authenticated) with the shared secret, read
// its manifest (MAC-checked, then fully validated like any untrusted manifest), fetch tensors in pipelined chunks
// into caller memory and verify each tensor's checksum. Every reply must be exactly as long as what was asked.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "weights/peer_wire.h"
#include "weights/store_format.h"

namespace bg::weights {

class UcxWorker;

struct PeerClientOptions {
  int timeout_ms = 60000;         // per request
  int connect_timeout_ms = 60000; // peers starting at the same time: retry the handshake until then
  int max_in_flight = 4;
  uint64_t chunk_bytes = uint64_t{16} << 20;
};

class PeerClient {
 public:
  // Connects and authenticates; throws naming the peer on a wrong secret, a refused or lost connection, a timeout,
  // or a manifest that fails its MAC or validation.
  PeerClient(std::string node, std::string host, uint16_t port, const std::string& secret,
             PeerClientOptions options = {});
  ~PeerClient();
  PeerClient(const PeerClient&) = delete;
  PeerClient& operator=(const PeerClient&) = delete;

  const Manifest& manifest() const { return manifest_; }
  const std::string& node() const { return node_; }
  // Fetches tensor `index` of the peer's manifest (exactly its bytes) into dst and verifies its checksum.
  void fetch(uint32_t index, std::byte* dst);
  // One read request of `bytes` at `offset` into tensor `index` (what fetch pipelines); the peer decides whether the
  // range is valid. Throws with the peer's error.
  void read(uint32_t index, uint64_t offset, uint64_t bytes, std::byte* dst);
  uint64_t bytes_received() const { return bytes_received_; }

  // Reply bookkeeping, used by the active-message callback.
  struct Pending {
    std::byte* dst = nullptr;              // null: a reply whose payload goes to `buffer` (the manifest)
    uint64_t expected = 0;                 // payload bytes the request asked for (manifest: up to the limit)
    std::vector<std::byte> buffer;
    PeerReply reply;
    bool replied = false;                  // the header arrived
    bool done = false;                     // header and payload arrived
    std::string error;
  };

 private:
  uint64_t send(const PeerRequest& request, Pending pending);
  Pending& wait(uint64_t id);
  void handshake(const std::string& secret);
  std::string what() const;

  std::string node_, host_;
  uint16_t port_ = 0;
  PeerClientOptions o_;
  std::unique_ptr<UcxWorker> worker_;
  void* ep_ = nullptr;  // ucp_ep_h
  bool ep_failed_ = false;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Pending> pending_;
  Manifest manifest_;
  uint64_t bytes_received_ = 0;

  friend struct PeerClientCallbacks;
};

}  // namespace bg::weights
