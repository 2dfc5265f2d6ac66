// The control thread of node 0: agents' hellos, starts and kills per incarnation, reports, heartbeats, goodbyes.
#include "server/frontend/node_link.h"

#include <fmt/format.h>

#include <zmq_addon.hpp>

#include <cerrno>

#include "core/error.h"
#include "core/log.h"
#include "server/frontend/node_protocol.h"

namespace bg::frontend {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

namespace {

double seconds(std::chrono::milliseconds d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

NodeLink::NodeLink(zmq::context_t& ctx, NodeLinkConfig cfg)
    : cfg_(std::move(cfg)), sock_(ctx, zmq::socket_type::router) {
  BG_CHECK(cfg_.layout.nnodes() > 1, "node link: {} has one node", cfg_.layout.describe());
  BG_CHECK(static_cast<bool>(cfg_.rendezvous), "node link: no rendezvous source");
  dist::secure_bind_side(sock_, cfg_.key.get());
  sock_.set(zmq::sockopt::linger, 1000);  // the goodbye reaches the agents on close
  sock_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(nodes::kMaxFrameBytes));
  sock_.set(zmq::sockopt::router_mandatory, 1);
  try {
    sock_.bind(cfg_.endpoint);
  } catch (const zmq::error_t& e) {
    fail("serve: cannot bind the node control socket {} (--dist-init-addr {}: an address of node 0 and a free port; "
         "serve also uses the next port): {}", cfg_.endpoint, cfg_.dist_init_addr, e.what());
  }
  nodes_.resize(static_cast<size_t>(cfg_.layout.nnodes()));
  ranks_.resize(static_cast<size_t>(cfg_.layout.world()));
  thread_ = std::thread([this] { run(); });
}

NodeLink::~NodeLink() {
  {
    std::lock_guard lock(mu_);
    for (Node& n : nodes_) {
      if (n.connected) queue_locked(n.identity, nodes::encode("bye", json{{"reason", "node 0 is shutting down"}}));
    }
  }
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  flush_outbox();  // the thread is gone: this thread owns the socket now
}

void NodeLink::start(int64_t incarnation, const std::vector<std::string>& identities) {
  BG_CHECK(identities.size() == ranks_.size(), "node link: {} routing ids for {} ranks", identities.size(),
           ranks_.size());
  const std::string rendezvous = cfg_.rendezvous();
  std::lock_guard lock(mu_);
  incarnation_ = incarnation;
  rendezvous_ = rendezvous;
  identities_ = identities;
  for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r] = RankRecord{incarnation, 0, false, 0};
  for (int32_t k = 1; k < cfg_.layout.nnodes(); ++k) {
    if (nodes_[static_cast<size_t>(k)].connected) send_start_locked(k);
  }
}

void NodeLink::kill(int64_t incarnation) {
  std::lock_guard lock(mu_);
  killed_incarnation_ = std::max(killed_incarnation_, incarnation);  // a late agent is not sent its start
  for (Node& n : nodes_) {
    if (n.connected && n.started_incarnation == incarnation) {
      queue_locked(n.identity, nodes::encode("kill", json{{"incarnation", incarnation}}));
    }
  }
}

RemoteRank NodeLink::state(int32_t rank, int64_t incarnation) const {
  std::lock_guard lock(mu_);
  RemoteRank s;
  s.node = cfg_.layout.node_of(rank);
  const Node& n = nodes_[static_cast<size_t>(s.node)];
  const RankRecord& rr = ranks_[static_cast<size_t>(rank)];
  if (rr.incarnation == incarnation) {
    s.pid = rr.pid;
    s.exited = rr.exited;
    s.wait_status = rr.wait_status;
  }
  s.started = n.started_incarnation == incarnation || n.lost_incarnation == incarnation;
  if (n.lost_incarnation == incarnation) s.node_gone = n.lost_reason;
  if (!s.started) {
    s.waiting = n.lost_reason.empty()
                    ? fmt::format("node {} has not connected: run the same serve command there with --node-rank {} "
                                  "(it must reach --dist-init-addr {})", s.node, s.node, cfg_.dist_init_addr)
                    : fmt::format("node {} has no agent ({}); run its serve command again", s.node, n.lost_reason);
  }
  return s;
}

int32_t NodeLink::n_connected() const {
  std::lock_guard lock(mu_);
  int32_t n = 1;
  for (size_t k = 1; k < nodes_.size(); ++k) n += nodes_[k].connected ? 1 : 0;
  return n;
}

void NodeLink::queue_locked(const std::string& identity, const std::string& frame) {
  outbox_.emplace_back(identity, frame);
}

void NodeLink::send_start_locked(int32_t k) {
  Node& n = nodes_[static_cast<size_t>(k)];
  if (incarnation_ == 0 || incarnation_ <= killed_incarnation_ || n.started_incarnation >= incarnation_ ||
      n.lost_incarnation == incarnation_) {
    return;  // nothing current, already sent, or this incarnation is failing with the agent it lost
  }
  nodes::StartRanks s;
  s.incarnation = incarnation_;
  s.rendezvous = rendezvous_;
  const int32_t first = cfg_.layout.first_rank_of(k);
  for (int32_t r = first; r < first + cfg_.layout.ranks_per_node(); ++r) {
    s.ranks.emplace_back(r, identities_[static_cast<size_t>(r)]);
  }
  queue_locked(n.identity, nodes::encode("start", nodes::to_json(s)));
  n.started_incarnation = incarnation_;
  log::info("frontend: node {}: starting ranks {}..{} of incarnation {} (agent pid {} on {})", k, first,
            first + cfg_.layout.ranks_per_node() - 1, incarnation_, n.pid, n.host);
}

void NodeLink::lose_locked(int32_t k, const std::string& why) {
  Node& n = nodes_[static_cast<size_t>(k)];
  if (!n.connected) return;
  n.connected = false;
  n.lost_reason = why;
  n.lost_incarnation = n.started_incarnation;
  n.started_incarnation = 0;
  log::error("frontend: node {}: {}", k, why);
}

int32_t NodeLink::node_of_identity(const std::string& identity) const {
  for (size_t k = 1; k < nodes_.size(); ++k) {
    if (nodes_[k].connected && nodes_[k].identity == identity) return static_cast<int32_t>(k);
  }
  return -1;
}

void NodeLink::on_hello(const std::string& identity, const json& body) {
  const nodes::Hello h = nodes::parse_hello(body);
  const int32_t nnodes = cfg_.layout.nnodes();
  auto refuse = [&](const std::string& why) {
    log::warn("frontend: refused a node agent (pid {} on {}): {}", h.pid, h.host.substr(0, 64), why);
    queue_locked(identity, nodes::encode("error", json{{"reason", why}}));
  };
  if (h.nnodes != nnodes || h.node_rank < 1 || h.node_rank >= nnodes) {
    return refuse(fmt::format("it was started with --nnodes {} --node-rank {}; node 0 runs --nnodes {}, so the other "
                              "nodes are 1..{}", h.nnodes, h.node_rank, nnodes, nnodes - 1));
  }
  if (h.config != cfg_.config) {
    return refuse(fmt::format("node {} was started with '{}', node 0 with '{}': every node runs the same layout and "
                              "rank options", h.node_rank, h.config, cfg_.config));
  }
  Node& n = nodes_[static_cast<size_t>(h.node_rank)];
  if (n.connected && n.identity != identity) {
    return refuse(fmt::format("node rank {} is already taken by the agent pid {} on {}", h.node_rank, n.pid, n.host));
  }
  const bool again = n.connected;
  n.identity = identity;
  n.connected = true;
  n.pid = h.pid;
  n.host = h.host;
  n.last_seen = Clock::now();
  n.lost_reason.clear();
  queue_locked(identity, nodes::encode("welcome"));
  if (!again) log::info("frontend: node {} joined (agent pid {} on {})", h.node_rank, h.pid, h.host);
  send_start_locked(h.node_rank);
}

void NodeLink::on_report(int32_t k, const std::string& type, const json& body) {
  if (type == "bye") {
    lose_locked(k, fmt::format("its agent stopped ({})", nodes::parse_reason(body)));
    return;
  }
  if (type == "heartbeat") return;
  const nodes::RankProcess p = nodes::parse_rank_process(body);
  BG_CHECK(cfg_.layout.node_of(p.rank) == k, "node {} reported rank {}, which runs on node {}", k, p.rank,
           cfg_.layout.node_of(p.rank));
  RankRecord& rr = ranks_[static_cast<size_t>(p.rank)];
  if (p.incarnation != rr.incarnation) return;  // an earlier incarnation's last words
  rr.pid = p.pid;
  if (type == "exited") {
    rr.exited = true;
    rr.wait_status = p.wait_status;
  }
}

void NodeLink::on_message(const std::string& identity, const std::string& frame) {
  std::lock_guard lock(mu_);
  const int32_t k = node_of_identity(identity);
  try {
    if (k < 0) {
      const nodes::ControlMessage m = nodes::decode(frame, {"hello"});
      on_hello(identity, m.body);
      return;
    }
    nodes_[static_cast<size_t>(k)].last_seen = Clock::now();
    const nodes::ControlMessage m = nodes::decode(frame, {"hello", "heartbeat", "started", "exited", "bye"});
    if (m.type != "hello") on_report(k, m.type, m.body);
  } catch (const std::exception& e) {
    ++n_dropped_;  // at most one line a second: a confused peer could send many
    const auto now = Clock::now();
    if (now - last_drop_log_ < std::chrono::seconds(1)) return;
    last_drop_log_ = now;
    log::warn("frontend: dropped a control message from {} ({} so far): {}",
              k < 0 ? std::string("an unknown peer") : fmt::format("node {}", k), n_dropped_, e.what());
  }
}

void NodeLink::tick_locked(Clock::time_point now) {
  for (int32_t k = 1; k < cfg_.layout.nnodes(); ++k) {
    Node& n = nodes_[static_cast<size_t>(k)];
    if (!n.connected) continue;
    if (now - n.last_seen > cfg_.node_timeout) {
      lose_locked(k, fmt::format("its agent (pid {} on {}) sent nothing for {:.1f} s (--node-timeout)", n.pid, n.host,
                                 seconds(cfg_.node_timeout)));
    } else if (now - n.last_sent >= nodes::kHeartbeatInterval) {
      queue_locked(n.identity, nodes::encode("heartbeat"));
      n.last_sent = now;
    }
  }
}

// Sends what other threads queued; a send to an agent that is gone fails (ROUTER_MANDATORY), never blocks.
void NodeLink::flush_outbox() {
  std::vector<std::pair<std::string, std::string>> out;
  {
    std::lock_guard lock(mu_);
    out.swap(outbox_);
  }
  for (const auto& [identity, frame] : out) {
    try {
      if (sock_.send(zmq::buffer(identity), zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
        sock_.send(zmq::buffer(frame), zmq::send_flags::dontwait);
      }
    } catch (const zmq::error_t& e) {
      // EHOSTUNREACH: the agent's connection is gone (its process died, or the network between the nodes failed).
      // The heartbeats find this within kHeartbeatInterval, long before --node-timeout.
      std::lock_guard lock(mu_);
      if (const int32_t k = node_of_identity(identity); k > 0 && e.num() == EHOSTUNREACH) {
        lose_locked(k, fmt::format("its agent (pid {} on {}) disconnected", nodes_[static_cast<size_t>(k)].pid,
                                   nodes_[static_cast<size_t>(k)].host));
      }
    }
  }
}

void NodeLink::run() {
  zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
  while (!stop_) {
    zmq::poll(&item, 1, std::chrono::milliseconds(50));
    if (item.revents & ZMQ_POLLIN) {
      std::vector<zmq::message_t> parts;
      while (zmq::recv_multipart(sock_, std::back_inserter(parts), zmq::recv_flags::dontwait)) {
        if (parts.size() == 2) on_message(parts[0].to_string(), parts[1].to_string());
        parts.clear();
      }
    }
    {
      std::lock_guard lock(mu_);
      tick_locked(Clock::now());
    }
    flush_outbox();
  }
}

}  // namespace bg::frontend
