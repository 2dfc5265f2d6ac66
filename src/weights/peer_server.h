// The serving side of the weight peers: a weightd whose node is in the distributed config serves its store to the
// other nodes' daemons and engines over UCX. A client must pass the mutual HMAC challenge before it sees the manifest
// or a byte; every read is checked against the server's own manifest (tensor index, offset and length inside that
// tensor, at most kPeerMaxRead), so a client can never make it send memory outside a tensor.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "weights/store_format.h"

namespace bg::weights {

// What a server serves: the encoded manifest and the tensors' bytes.
class PeerCatalog {
 public:
  virtual ~PeerCatalog() = default;
  virtual std::span<const std::byte> manifest_bytes() const = 0;  // encode_manifest of what is served
  virtual size_t n_tensors() const = 0;
  virtual uint64_t tensor_bytes(uint32_t index) const = 0;
  // Called only with a range already checked against tensor_bytes(index).
  virtual std::span<const std::byte> read(uint32_t index, uint64_t offset, uint64_t bytes) const = 0;
};

// A mapped store as a catalog (the segment memory must outlive the catalog).
class StoreCatalog final : public PeerCatalog {
 public:
  StoreCatalog(const Manifest& m, std::vector<const std::byte*> segment_bases);
  std::span<const std::byte> manifest_bytes() const override { return encoded_; }
  size_t n_tensors() const override { return m_.tensors.size(); }
  uint64_t tensor_bytes(uint32_t index) const override { return m_.tensors.at(index).bytes; }
  std::span<const std::byte> read(uint32_t index, uint64_t offset, uint64_t bytes) const override;

 private:
  Manifest m_;
  std::vector<const std::byte*> bases_;
  std::vector<std::byte> encoded_;
};

struct PeerServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: any free port (tests)
  std::string secret;
  size_t max_sessions = 256;
};

class PeerServer {
 public:
  // Starts listening on its own thread; throws when it cannot listen.
  PeerServer(PeerServerOptions options, std::shared_ptr<const PeerCatalog> catalog);
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  uint16_t port() const { return port_; }
  uint64_t bytes_served() const { return bytes_served_.load(); }
  uint64_t n_refused() const { return n_refused_.load(); }  // failed authentications and rejected requests

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> bytes_served_{0};
  std::atomic<uint64_t> n_refused_{0};
};

}  // namespace bg::weights
