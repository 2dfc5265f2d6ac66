// The node agent: one thread, one DEALER to node 0, this node's worker processes as children.
#include "server/frontend/node_agent.h"

#include <fmt/ranges.h>
#include <netdb.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include <zmq.hpp>

#include "core/error.h"
#include "core/log.h"
#include "core/spawn.h"
#include "dist/link_key.h"
#include "dist/shm_comm.h"
#include "server/frontend/node_protocol.h"
#include "server/frontend/worker_manager.h"

namespace bg::frontend {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr std::chrono::milliseconds kStopGrace{5'000};  // workers told to stop get this long before SIGKILL

std::string host_name() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

class NodeAgent {
 public:
  explicit NodeAgent(const ServeOptions& opt);
  ~NodeAgent() { stop_workers(std::chrono::milliseconds(0)); }
  NodeAgent(const NodeAgent&) = delete;
  NodeAgent& operator=(const NodeAgent&) = delete;
  int run(const sigset_t& signals);

 private:
  struct Child {
    int32_t rank = 0;
    pid_t pid = -1;
    int64_t incarnation = 0;
    bool exited = false;
  };

  void send(const std::string& type, const json& body = json::object());
  void on_message(const std::string& frame);
  void start_ranks(const nodes::StartRanks& s);
  void kill_workers(int sig);
  void reap(bool block);
  void stop_workers(std::chrono::milliseconds grace);

  const ServeOptions& opt_;
  const dist::ParallelLayout layout_;
  const nodes::NodeEndpoints ep_;
  const int32_t node_;
  const std::string exe_;
  zmq::context_t ctx_;
  zmq::socket_t sock_;
  std::vector<Child> children_;
  int64_t incarnation_ = 0;
  bool welcomed_ = false;
  bool goodbye_ = false;
  Clock::time_point last_heard_;
  Clock::time_point last_sent_;
  Clock::time_point joining_since_;  // when the agent last started waiting for node 0 (start, or node 0 lost)
  bool rejoining_ = false;           // node 0 was lost once: waiting for it to come back
};

NodeAgent::NodeAgent(const ServeOptions& opt)
    : opt_(opt),
      layout_(dist::ParallelLayout::from_flags(opt.parallel)),
      ep_(nodes::node_endpoints(opt.dist_init_addr)),
      node_(opt.parallel.node_rank),
      exe_(std::filesystem::read_symlink("/proc/self/exe").string()),
      ctx_(1),
      sock_(ctx_, zmq::socket_type::dealer) {
  dist::secure_connect_side(sock_, dist::load_link_key(opt.node_secret_file).get());
  sock_.set(zmq::sockopt::linger, 500);  // the last reports and the goodbye, if node 0 still listens
  // Its own routing id, kept across a reconnect (node 0 knows the agent by it); random, so two agents never share one.
  std::random_device rd;
  sock_.set(zmq::sockopt::routing_id, fmt::format("node-{}-{}-{:08x}", node_, getpid(), rd()));
  sock_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(nodes::kMaxFrameBytes));
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  const int gai = getaddrinfo(ep_.host.c_str(), nullptr, &hints, &found);
  if (found != nullptr) freeaddrinfo(found);
  BG_CHECK(gai == 0, "node {}: --dist-init-addr {}: cannot resolve '{}': {}", node_, opt.dist_init_addr, ep_.host,
           gai_strerror(gai));
  try {
    sock_.connect(ep_.control);
  } catch (const zmq::error_t& e) {
    fail("node {}: cannot connect to node 0 at {} (--dist-init-addr {}): {}", node_, ep_.control, opt.dist_init_addr,
         e.what());
  }
}

void NodeAgent::send(const std::string& type, const json& body) {
  const std::string frame = nodes::encode(type, body);
  try {
    (void)sock_.send(zmq::buffer(frame), zmq::send_flags::dontwait);  // node 0 gone: dropped, noticed by silence
  } catch (const zmq::error_t& e) {
    log::debug("node {}: a '{}' to node 0 was not sent: {}", node_, type, e.what());
  }
  last_sent_ = Clock::now();
}

void NodeAgent::on_message(const std::string& frame) {
  nodes::ControlMessage m;
  try {
    m = nodes::decode(frame, {"welcome", "error", "start", "kill", "heartbeat", "bye"});
  } catch (const std::exception& e) {
    log::warn("node {}: dropped a message from node 0: {}", node_, e.what());
    return;
  }
  last_heard_ = Clock::now();
  if (m.type == "error") {
    fail("node {}: node 0 refused this node: {}", node_, nodes::parse_reason(m.body));
  }
  if (m.type == "welcome") {
    if (!welcomed_) log::info("node {}: node 0 at {} accepted this node; waiting for its word", node_, ep_.control);
    welcomed_ = true;
    return;
  }
  if (!welcomed_) return;  // nothing but a welcome or a refusal comes first
  try {
    if (m.type == "start") {
      start_ranks(nodes::parse_start(m.body, layout_.world(), layout_.nnodes(), node_, ep_.host));
    } else if (m.type == "kill") {
      const int64_t inc = m.body.value("incarnation", int64_t{-1});
      if (inc == incarnation_) kill_workers(SIGKILL);
    } else if (m.type == "bye") {
      log::info("node {}: node 0 says goodbye ({})", node_, nodes::parse_reason(m.body));
      goodbye_ = true;
    }
  } catch (const std::exception& e) {
    log::warn("node {}: dropped a '{}' from node 0: {}", node_, m.type, e.what());
  }
}

void NodeAgent::start_ranks(const nodes::StartRanks& s) {
  if (s.incarnation <= incarnation_) return;  // already started (or older)
  kill_workers(SIGKILL);  // an earlier incarnation's ranks never outlive it
  reap(/*block=*/true);
  children_.clear();
  incarnation_ = s.incarnation;
  for (const auto& [rank, id] : s.ranks) {
    const std::vector<std::string> argv = worker_command(opt_, exe_, ep_.worker_link, rank, id, s.rendezvous);
    Child c{rank, -1, s.incarnation, false};
    try {
      c.pid = spawn_child(argv, SpawnOptions{.own_process_group = true, .default_sigpipe = true});
    } catch (const Error& e) {
      log::error("node {}: rank {} could not be started: {}", node_, rank, e.what());
      send("exited", nodes::to_json(nodes::RankProcess{s.incarnation, rank, getpid(), 127 << 8}));
      continue;
    }
    log::info("node {}: started rank {} (pid {}): {}", node_, rank, c.pid, fmt::join(argv, " "));
    send("started", nodes::to_json(nodes::RankProcess{s.incarnation, rank, c.pid, 0}));
    children_.push_back(c);
  }
}

void NodeAgent::kill_workers(int sig) {
  for (const Child& c : children_) {
    if (!c.exited) ::kill(c.pid, sig);
  }
}

// Reaps exited workers (all of them, within 10 s, when `block`) and reports each exit to node 0.
void NodeAgent::reap(bool block) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (Child& c : children_) {
    while (!c.exited) {
      int status = 0;
      const pid_t got = waitpid(c.pid, &status, WNOHANG);
      if (got == c.pid || (got < 0 && errno == ECHILD)) {
        c.exited = true;
        log::info("node {}: rank {} (pid {}) stopped: {}", node_, c.rank, c.pid, describe_exit(status));
        send("exited", nodes::to_json(nodes::RankProcess{c.incarnation, c.rank, c.pid, status & 0xffff}));
      } else if (!block || Clock::now() > deadline) {
        break;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  }
}

// SIGTERM, `grace` for the workers to exit, then SIGKILL; every one reaped.
void NodeAgent::stop_workers(std::chrono::milliseconds grace) {
  kill_workers(SIGTERM);
  const auto deadline = Clock::now() + grace;
  for (;;) {
    reap(/*block=*/false);
    bool alive = false;
    for (const Child& c : children_) alive = alive || !c.exited;
    if (!alive || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill_workers(SIGKILL);
  reap(/*block=*/true);
}

int NodeAgent::run(const sigset_t& signals) {
  const nodes::Hello h{node_, layout_.nnodes(), node_config_signature(opt_), getpid(), host_name()};
  send("hello", nodes::to_json(h));
  const int32_t first = layout_.first_rank_of(node_);
  log::info("serve: node {} of {} ({}): agent for ranks {}..{}; node 0 is {}", node_, layout_.nnodes(),
            layout_.describe(), first, first + layout_.ranks_per_node() - 1, ep_.control);
  joining_since_ = Clock::now();
  const auto join_timeout = std::chrono::duration<double>(dist::rank_timeout_s(600.0));
  const auto silence = std::chrono::duration<double>(opt_.node_timeout_s);
  zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
  const timespec no_wait{0, 0};
  while (!goodbye_) {
    zmq::poll(&item, 1, std::chrono::milliseconds(50));
    zmq::message_t msg;
    while ((item.revents & ZMQ_POLLIN) && sock_.recv(msg, zmq::recv_flags::dontwait)) on_message(msg.to_string());
    reap(/*block=*/false);
    if (const int sig = sigtimedwait(&signals, nullptr, &no_wait); sig > 0) {
      log::info("serve: node {}: {} received; stopping this node's ranks", node_, sig == SIGINT ? "SIGINT" : "SIGTERM");
      stop_workers(kStopGrace);
      send("bye", json{{"reason", fmt::format("node {} was stopped by a signal", node_)}});
      return 0;
    }
    const auto now = Clock::now();
    if (!welcomed_ && now - joining_since_ > join_timeout) {
      if (rejoining_) {
        fail("node {}: node 0 did not come back at {} within {:.0f} s (BG_RANK_TIMEOUT_S); this node's ranks are "
             "stopped", node_, ep_.control, join_timeout.count());
      }
      fail("node {}: node 0 did not answer at {} within {:.0f} s (BG_RANK_TIMEOUT_S): is its serve running, and is "
           "--dist-init-addr {} its address?{}", node_, ep_.control, join_timeout.count(), opt_.dist_init_addr,
           opt_.node_secret_file.empty() ? "" : " Does node 0 use the same --node-secret-file (a peer with another "
           "secret is dropped during the handshake)?");
    }
    if (welcomed_ && now - last_heard_ > silence) {
      // Node 0 is gone (killed, crashed, cut off): no rank of this node may outlive its set, so they stop now. The
      // agent stays and says hello again until node 0 answers (a restarted serve takes this node back) or the rank
      // timeout passes.
      stop_workers(std::chrono::milliseconds(0));
      log::warn("node {}: node 0 ({}) sent nothing for {:.1f} s (--node-timeout); this node's ranks were stopped; "
                "waiting up to {:.0f} s (BG_RANK_TIMEOUT_S) for node 0 to come back", node_, ep_.control,
                silence.count(), join_timeout.count());
      children_.clear();
      incarnation_ = 0;  // a restarted node 0 counts its incarnations from 1 again
      welcomed_ = false;
      rejoining_ = true;
      joining_since_ = now;
    }
    // Until node 0 answers, a hello a second: queued while node 0 is down, delivered once its socket is back.
    if (!welcomed_ && now - last_sent_ >= std::chrono::seconds(1)) send("hello", nodes::to_json(h));
    if (welcomed_ && now - last_sent_ >= nodes::kHeartbeatInterval) send("heartbeat");
  }
  stop_workers(kStopGrace);  // node 0 asked its ranks to shut down before its goodbye: they are leaving already
  log::info("serve: node {}: every rank stopped", node_);
  return 0;
}

}  // namespace

int run_node_agent(const ServeOptions& opt) {
  const sigset_t signals = block_stop_signals();
  NodeAgent agent(opt);
  return agent.run(signals);
}

}  // namespace bg::frontend
