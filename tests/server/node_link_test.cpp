// Node 0's control link with fake node agents (in-process DEALERs): one agent per node, with node 0's config and a
// node rank in range, or a refusal that says why; starts per incarnation (late agents get the current one, nobody
// gets a killed one), reports only for the agent's own ranks and the current incarnation, and an agent that says
// goodbye, falls silent or disconnects is gone; with a node secret, only agents holding it are heard. Plus the
// message parsers, which trust nothing.
#include <gtest/gtest.h>

#include <thread>

#include "core/error.h"
#include "process_testing.h"
#include "temp_dir.h"
#include "server/frontend/node_link.h"
#include "server/frontend/node_protocol.h"

namespace bg::frontend {
namespace {

using namespace std::chrono_literals;
using bg::testing::eventually;
using json = nlohmann::json;

std::string endpoint() {
  static int n = 0;
  return "inproc://node-link-test-" + std::to_string(n++);
}

const char* kConfig = "dp=4 tp=1 ep=4 (4 ranks on 2 nodes); --device cpu";

NodeLinkConfig config(const std::string& ep, std::chrono::milliseconds node_timeout = 10'000ms) {
  dist::ParallelFlags f;
  f.ep = 4;
  f.nnodes = 2;
  return NodeLinkConfig{ep, "127.0.0.1:29500", dist::ParallelLayout::from_flags(f), kConfig, node_timeout,
                        [] { return std::string("tcp://127.0.0.1:40000"); }, nullptr};
}

// A node agent as the test drives it: says hello, answers nothing by itself.
class FakeAgent {
 public:
  FakeAgent(zmq::context_t& ctx, const std::string& ep, const std::string& id, const dist::LinkKey* key = nullptr)
      : sock_(ctx, zmq::socket_type::dealer) {
    dist::secure_connect_side(sock_, key);
    sock_.set(zmq::sockopt::routing_id, id);
    sock_.set(zmq::sockopt::linger, 0);
    sock_.connect(ep);
  }
  void send(const std::string& type, const json& body = json::object()) {
    const std::string f = nodes::encode(type, body);
    sock_.send(zmq::buffer(f), zmq::send_flags::none);
  }
  void send_raw(const std::string& frame) { sock_.send(zmq::buffer(frame), zmq::send_flags::none); }
  void hello(int32_t node_rank, const std::string& cfg = kConfig, int32_t nnodes = 2) {
    send("hello", nodes::to_json(nodes::Hello{node_rank, nnodes, cfg, 4242, "node-host"}));
  }
  // The next message other than a heartbeat, or type "" after `limit`.
  nodes::ControlMessage next(std::chrono::milliseconds limit = 3000ms) {
    const auto end = std::chrono::steady_clock::now() + limit;
    zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
    while (std::chrono::steady_clock::now() < end) {
      zmq::poll(&item, 1, 20ms);
      zmq::message_t msg;
      if ((item.revents & ZMQ_POLLIN) && sock_.recv(msg, zmq::recv_flags::dontwait)) {
        nodes::ControlMessage m = nodes::decode(msg.to_string(), {"welcome", "error", "start", "kill", "heartbeat",
                                                                  "bye"});
        if (m.type != "heartbeat") return m;
      }
    }
    return {};
  }
  void close() { sock_.close(); }

 private:
  zmq::socket_t sock_;
};

std::vector<std::string> ids(int64_t incarnation) {
  std::vector<std::string> out;
  for (int r = 0; r < 4; ++r) out.push_back("rank-" + std::to_string(r) + "-i" + std::to_string(incarnation) + "-ab");
  return out;
}

TEST(NodeLink, OneAgentPerNodeWithNodeZerosConfig) {
  zmq::context_t ctx;
  const std::string ep = endpoint();
  NodeLink link(ctx, config(ep));
  FakeAgent a(ctx, ep, "agent-a");
  a.hello(1);
  EXPECT_EQ(a.next().type, "welcome");
  EXPECT_TRUE(eventually([&] { return link.n_connected() == 2; }));

  FakeAgent b(ctx, ep, "agent-b");  // a second agent claiming node 1
  b.hello(1);
  nodes::ControlMessage m = b.next();
  ASSERT_EQ(m.type, "error");
  EXPECT_NE(nodes::parse_reason(m.body).find("node rank 1 is already taken by the agent pid 4242"),
            std::string::npos);

  FakeAgent c(ctx, ep, "agent-c");  // another layout
  c.hello(1, "dp=2 tp=1 ep=2 (2 ranks on 2 nodes); --device cpu");
  m = c.next();
  ASSERT_EQ(m.type, "error");
  EXPECT_NE(nodes::parse_reason(m.body).find("every node runs the same layout"), std::string::npos);

  FakeAgent d(ctx, ep, "agent-d");  // out of range, and another node count
  d.hello(2);
  m = d.next();
  ASSERT_EQ(m.type, "error");
  EXPECT_NE(nodes::parse_reason(m.body).find("the other nodes are 1..1"), std::string::npos);
  d.hello(1, kConfig, 3);
  EXPECT_EQ(d.next().type, "error");

  FakeAgent e(ctx, ep, "agent-e");  // junk is dropped, never answered
  e.send_raw("{not json");
  e.send_raw(std::string(nodes::kMaxFrameBytes + 1, 'x'));
  e.send("exited", nodes::to_json(nodes::RankProcess{1, 2, 9, 9}));  // a report before any hello
  EXPECT_EQ(e.next(300ms).type, "");
  EXPECT_EQ(link.n_connected(), 2);
}

TEST(NodeLink, WithASecretOnlyAgentsHoldingItAreHeard) {
  bg::testing::TempDir tmp;
  zmq::context_t ctx;
  const std::string ep = "ipc://" + (tmp / "control.sock").string();  // CURVE runs over ipc and tcp, not inproc
  NodeLinkConfig cfg = config(ep);
  cfg.key = std::make_shared<const dist::LinkKey>(dist::derive_link_key(std::string(32, 'k')));
  NodeLink link(ctx, cfg);
  const dist::LinkKey other = dist::derive_link_key(std::string(32, 'o'));
  FakeAgent plain(ctx, ep, "agent-plain"), wrong(ctx, ep, "agent-wrong", &other);
  plain.hello(1);
  wrong.hello(1);
  EXPECT_EQ(plain.next(500ms).type, "") << "an agent without the secret is dropped in the handshake";
  EXPECT_EQ(wrong.next(10ms).type, "") << "so is one with another secret";
  EXPECT_EQ(link.n_connected(), 1);
  FakeAgent good(ctx, ep, "agent-good", cfg.key.get());
  good.hello(1);
  EXPECT_EQ(good.next().type, "welcome");
  EXPECT_TRUE(eventually([&] { return link.n_connected() == 2; }));
}

TEST(NodeLink, StartsKillsAndReportsPerIncarnation) {
  zmq::context_t ctx;
  const std::string ep = endpoint();
  NodeLink link(ctx, config(ep));
  EXPECT_TRUE(link.is_remote(2));
  EXPECT_FALSE(link.is_remote(1));
  link.start(1, ids(1));  // no agent yet: the start waits for it
  RemoteRank s = link.state(2, 1);
  EXPECT_FALSE(s.started);
  EXPECT_EQ(s.node, 1);
  EXPECT_NE(s.waiting.find("node 1 has not connected"), std::string::npos) << s.waiting;

  FakeAgent a(ctx, ep, "agent-a");
  a.hello(1);
  EXPECT_EQ(a.next().type, "welcome");
  nodes::ControlMessage m = a.next();
  ASSERT_EQ(m.type, "start");
  const nodes::StartRanks st = nodes::parse_start(m.body, 4, 2, 1, "127.0.0.1");
  EXPECT_EQ(st.incarnation, 1);
  EXPECT_EQ(st.rendezvous, "tcp://127.0.0.1:40000");
  ASSERT_EQ(st.ranks.size(), 2u);
  EXPECT_EQ(st.ranks[0], std::make_pair(2, std::string("rank-2-i1-ab")));
  EXPECT_TRUE(link.state(3, 1).started);

  a.send("started", nodes::to_json(nodes::RankProcess{1, 2, 777, 0}));
  a.send("exited", nodes::to_json(nodes::RankProcess{1, 1, 778, 9}));  // rank 1 runs on node 0: not node 1's
  a.send("exited", nodes::to_json(nodes::RankProcess{1, 3, 779, 9}));
  EXPECT_TRUE(eventually([&] { return link.state(3, 1).exited; }));
  EXPECT_EQ(link.state(3, 1).wait_status, 9);
  EXPECT_EQ(link.state(2, 1).pid, 777);
  EXPECT_FALSE(link.state(2, 1).exited);
  EXPECT_FALSE(link.state(1, 1).exited);

  link.kill(1);
  m = a.next();
  ASSERT_EQ(m.type, "kill");
  EXPECT_EQ(m.body["incarnation"], 1);

  link.start(2, ids(2));
  m = a.next();
  ASSERT_EQ(m.type, "start");
  EXPECT_EQ(nodes::parse_start(m.body, 4, 2, 1, "127.0.0.1").incarnation, 2);
  a.send("exited", nodes::to_json(nodes::RankProcess{1, 2, 777, 9}));  // the old incarnation's last words
  std::this_thread::sleep_for(150ms);
  EXPECT_FALSE(link.state(2, 2).exited);

  link.kill(3);  // incarnation 3 was killed before it started: a late agent is not sent it
  link.start(3, ids(3));
  EXPECT_EQ(a.next(300ms).type, "");
}

TEST(NodeLink, AnAgentThatSaysGoodbyeFallsSilentOrDisconnectsIsGone) {
  zmq::context_t ctx;
  const std::string ep = endpoint();
  NodeLink link(ctx, config(ep, 600ms));
  link.start(1, ids(1));
  {
    FakeAgent a(ctx, ep, "agent-a");
    a.hello(1);
    EXPECT_EQ(a.next().type, "welcome");
    EXPECT_EQ(a.next().type, "start");
    a.send("bye", json{{"reason", "stopped by a signal"}});
    EXPECT_TRUE(eventually([&] { return !link.state(2, 1).node_gone.empty(); }));
    EXPECT_NE(link.state(2, 1).node_gone.find("its agent stopped (stopped by a signal)"), std::string::npos);
  }
  link.start(2, ids(2));
  EXPECT_NE(link.state(2, 2).waiting.find("node 1 has no agent (its agent stopped"), std::string::npos);
  FakeAgent quiet(ctx, ep, "agent-quiet");  // never sends a heartbeat
  quiet.hello(1);
  EXPECT_EQ(quiet.next().type, "welcome");
  EXPECT_EQ(quiet.next().type, "start");
  EXPECT_TRUE(eventually([&] { return !link.state(2, 2).node_gone.empty(); }, 3000ms));
  EXPECT_NE(link.state(2, 2).node_gone.find("sent nothing for 0.6 s (--node-timeout)"), std::string::npos);

  link.start(3, ids(3));
  FakeAgent gone(ctx, ep, "agent-gone");
  gone.hello(1);
  EXPECT_EQ(gone.next().type, "welcome");
  EXPECT_EQ(gone.next().type, "start");
  gone.close();  // its process died: found by the next heartbeat, well before the timeout
  EXPECT_TRUE(eventually([&] { return !link.state(2, 3).node_gone.empty(); }, 500ms));
  EXPECT_NE(link.state(2, 3).node_gone.find("disconnected"), std::string::npos) << link.state(2, 3).node_gone;
}

TEST(NodeProtocol, ParsersCheckEveryField) {
  EXPECT_THROW(nodes::node_endpoints(""), Error);
  EXPECT_THROW(nodes::node_endpoints("host"), Error);
  EXPECT_THROW(nodes::node_endpoints("host:0"), Error);
  EXPECT_THROW(nodes::node_endpoints("host:65535"), Error);
  EXPECT_THROW(nodes::node_endpoints("[::1]:29500"), Error);
  const nodes::NodeEndpoints e = nodes::node_endpoints("10.0.0.1:29500");
  EXPECT_EQ(e.control, "tcp://10.0.0.1:29500");
  EXPECT_EQ(e.worker_link, "tcp://10.0.0.1:29501");
  EXPECT_EQ(e.rendezvous_bind, "tcp://10.0.0.1:*");

  EXPECT_THROW(nodes::decode("[1]", {"hello"}), Error);
  EXPECT_THROW(nodes::decode(R"({"type": "hello", "body": 3})", {"hello"}), Error);
  EXPECT_THROW(nodes::decode(R"({"type": "start", "body": {}})", {"hello"}), Error);
  EXPECT_EQ(nodes::decode(R"({"type": "hello", "body": {}})", {"hello"}).type, "hello");

  json hello = nodes::to_json(nodes::Hello{1, 2, "c", 10, "h"});
  EXPECT_EQ(nodes::parse_hello(hello).node_rank, 1);
  hello["node_rank"] = "1";
  EXPECT_THROW(nodes::parse_hello(hello), Error);
  hello["node_rank"] = 1;
  hello["config"] = std::string(2000, 'c');
  EXPECT_THROW(nodes::parse_hello(hello), Error);

  nodes::StartRanks s{4, "tcp://10.0.0.1:40000", {{2, "rank-2-i4-ab"}, {3, "rank-3-i4-ab"}}};
  EXPECT_EQ(nodes::parse_start(nodes::to_json(s), 4, 2, 1, "10.0.0.1").ranks.size(), 2u);
  EXPECT_THROW(nodes::parse_start(nodes::to_json(s), 4, 2, 1, "10.0.0.2"), Error);  // a rendezvous elsewhere
  nodes::StartRanks bad = s;
  bad.ranks[1].first = 1;  // not this node's rank
  EXPECT_THROW(nodes::parse_start(nodes::to_json(bad), 4, 2, 1, "10.0.0.1"), Error);
  bad = s;
  bad.ranks[1].second = "rank-3-i4; rm -rf /";
  EXPECT_THROW(nodes::parse_start(nodes::to_json(bad), 4, 2, 1, "10.0.0.1"), Error);
  bad = s;
  bad.ranks.pop_back();
  EXPECT_THROW(nodes::parse_start(nodes::to_json(bad), 4, 2, 1, "10.0.0.1"), Error);
  bad = s;
  bad.rendezvous = "ipc:///tmp/x";
  EXPECT_THROW(nodes::parse_start(nodes::to_json(bad), 4, 2, 1, "10.0.0.1"), Error);

  json p = nodes::to_json(nodes::RankProcess{1, 2, 3, 9});
  EXPECT_EQ(nodes::parse_rank_process(p).wait_status, 9);
  p["rank"] = 99;
  EXPECT_THROW(nodes::parse_rank_process(p), Error);
  EXPECT_THROW(nodes::parse_reason(json{{"reason", 1}}), Error);
}

}  // namespace
}  // namespace bg::frontend
