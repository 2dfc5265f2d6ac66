// The rendezvous of a rank set over ZeroMQ: every rank joins with its place and its memory plan; once all have
// joined, each gets the set's transport id (rank 0's: the shm segment name on CPU, the NCCL unique id on CUDA) and
// the plan every rank will use (the elementwise minimum, so TP ranks size their pools alike). The frontend runs the
// server for `serve` (and, across nodes, binds it on --dist-init-addr); `score` / `generate` run it in rank 0.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <zmq.hpp>

#include "dist/link_key.h"

namespace bg::dist {

struct JoinInfo {
  int32_t rank = 0;
  int32_t world = 1;
  std::string layout;              // ParallelLayout::describe(): every rank must agree
  std::string transport_id;        // rank 0 only (bytes as hex)
  std::vector<int64_t> plan;       // numbers the set agrees on (elementwise minimum)
  int64_t pid = 0;
  std::string host;
};

struct WorldInfo {
  std::string transport_id;
  std::vector<int64_t> plan;
};

class RendezvousServer {
 public:
  // Binds `endpoint` (ipc://..., tcp://host:port) for a set of `world` ranks with `layout`; with a `key`, only ranks
  // holding the same node secret can connect (link_key.h).
  RendezvousServer(zmq::context_t& ctx, const std::string& endpoint, int32_t world, std::string layout,
                   const LinkKey* key = nullptr);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  const std::string& endpoint() const { return endpoint_; }
  // Ranks that have joined so far (all of them once the set is complete).
  std::vector<bool> joined() const;
  bool complete() const { return complete_; }

 private:
  void run();
  void on_join(const std::string& identity, const std::string& frame);
  void reply(const std::string& identity, const std::string& type, const std::string& body_json);

  zmq::socket_t sock_;
  std::string endpoint_;
  int32_t world_;
  std::string layout_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> complete_{false};
  mutable std::mutex mu_;
  std::vector<JoinInfo> joins_;
  std::vector<std::string> identities_;  // "" until the rank joined
};

// Joins the set at `endpoint` and waits for the world info; throws bg::Error on a rejection, when `abandon()`
// returns true (checked every 100 ms) or after timeout_s. `key`: the node secret's (the server's must be the same).
WorldInfo rendezvous_join(zmq::context_t& ctx, const std::string& endpoint, const JoinInfo& me, double timeout_s,
                          const std::function<bool()>& abandon = {}, const LinkKey* key = nullptr);

std::string to_hex(const void* data, size_t n);
std::vector<uint8_t> from_hex(const std::string& hex);

}  // namespace bg::dist
