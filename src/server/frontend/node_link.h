// Node 0's side of a serve that spans hosts: one thread owns the control ROUTER (bound on --dist-init-addr), accepts
// one agent per node 1.. (same layout and config as node 0, a node rank nobody else holds), sends each the start and
// kill of its ranks per incarnation, collects its reports (rank started / exited) and heartbeats both ways, and marks
// an agent that says goodbye or falls silent for --node-timeout as gone. The supervisor (WorkerManager) sees it as
// RemoteRanks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "dist/link_key.h"
#include "dist/parallel_layout.h"
#include "server/frontend/worker_manager.h"

namespace bg::frontend {

struct NodeLinkConfig {
  std::string endpoint;                          // tcp://HOST:PORT (node_endpoints(...).control)
  std::string dist_init_addr;                    // for messages ("--dist-init-addr HOST:PORT")
  dist::ParallelLayout layout;
  std::string config;                            // config_signature(): every agent must send the same
  std::chrono::milliseconds node_timeout{10'000};  // an agent silent this long is gone
  std::function<std::string()> rendezvous;       // the current incarnation's rendezvous endpoint
  dist::LinkKeyPtr key;                          // --node-secret-file's: only agents holding it connect (or null)
};

class NodeLink final : public RemoteRanks {
 public:
  // Binds the control socket (throws bg::Error naming --dist-init-addr when it cannot) and starts its thread.
  NodeLink(zmq::context_t& ctx, NodeLinkConfig cfg);
  // Tells every agent goodbye (they stop their ranks and exit) and stops the thread.
  ~NodeLink() override;
  NodeLink(const NodeLink&) = delete;
  NodeLink& operator=(const NodeLink&) = delete;

  bool is_remote(int32_t rank) const override { return cfg_.layout.node_of(rank) > 0; }
  int32_t node_of(int32_t rank) const override { return cfg_.layout.node_of(rank); }
  void start(int64_t incarnation, const std::vector<std::string>& identities) override;
  void kill(int64_t incarnation) override;
  RemoteRank state(int32_t rank, int64_t incarnation) const override;
  // Nodes whose agent is connected now (node 0 counts as one).
  int32_t n_connected() const;

 private:
  struct Node {
    std::string identity;       // the accepted agent's ROUTER id ("" none)
    bool connected = false;
    int64_t pid = 0;
    std::string host;
    std::chrono::steady_clock::time_point last_seen;
    std::chrono::steady_clock::time_point last_sent;
    int64_t started_incarnation = 0;  // the last incarnation whose start was sent to this node's agent
    int64_t lost_incarnation = -1;    // the incarnation its agent had started when it went away
    std::string lost_reason;
  };
  struct RankRecord {
    int64_t incarnation = 0;
    int64_t pid = 0;
    bool exited = false;
    int wait_status = 0;
  };

  void run();
  void on_message(const std::string& identity, const std::string& frame);
  void on_hello(const std::string& identity, const nlohmann::json& body);  // mu_ held
  void on_report(int32_t node, const std::string& type, const nlohmann::json& body);  // mu_ held
  void send_start_locked(int32_t node);
  void lose_locked(int32_t node, const std::string& why);
  void queue_locked(const std::string& identity, const std::string& frame);
  void flush_outbox();
  void tick_locked(std::chrono::steady_clock::time_point now);
  int32_t node_of_identity(const std::string& identity) const;  // mu_ held; -1 unknown

  NodeLinkConfig cfg_;
  zmq::socket_t sock_;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  mutable std::mutex mu_;  // guards everything below
  std::vector<Node> nodes_;                 // index = node rank (0 unused)
  std::vector<RankRecord> ranks_;           // index = rank
  std::vector<std::pair<std::string, std::string>> outbox_;  // (identity, frame), sent by the thread
  int64_t incarnation_ = 0;
  int64_t killed_incarnation_ = 0;
  std::string rendezvous_;
  std::vector<std::string> identities_;
  int64_t n_dropped_ = 0;
  std::chrono::steady_clock::time_point last_drop_log_;
};

}  // namespace bg::frontend
