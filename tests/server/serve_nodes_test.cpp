// `batchgen serve` across two "nodes" on this host (--device cpu --ep 2 --nnodes 2: node 0 serves HTTP with rank 0,
// node 1's agent runs rank 1): the chat answer equals one rank's; kill -9 of the remote rank gives a 503 and /ready
// naming the rank and its node, and the set comes back with the same answer; kill -9 of node 1's agent is reported
// and leaves no process behind; a new agent brings the set back and SIGTERM ends both nodes cleanly; an agent whose
// node 0 is killed stops its rank and exits. And the errors: another layout or a taken node rank is refused by node
// 0, an agent with another --node-secret-file is never heard (its own error says to check the secret), a node 0 that
// never answers or a node that never comes is named after the rank timeout, an unresolvable --dist-init-addr is an
// error at once.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <future>
#include <regex>
#include <thread>

#include <nlohmann/json.hpp>

#include "http_test_client.h"
#include "process_testing.h"
#include "temp_dir.h"

namespace bg::testing {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::json;

const std::string kExe = std::string(BG_BINARY_DIR) + "/batchgen";

// A child process with stdout and stderr in `log`; killed (SIGKILL) and reaped if the test ends first.
class Proc {
 public:
  Proc(const std::vector<std::string>& argv, std::filesystem::path log,
       const std::vector<std::pair<std::string, std::string>>& env = {})
      : log_(std::move(log)) {
    std::vector<char*> c;
    for (const std::string& a : argv) c.push_back(const_cast<char*>(a.c_str()));
    c.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      setenv("BG_NUM_THREADS", "1", 1);
      for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
      FILE* f = std::freopen(log_.c_str(), "w", stderr);
      (void)f;
      dup2(fileno(stderr), fileno(stdout));
      execv(c[0], c.data());
      _exit(127);
    }
  }
  ~Proc() {
    if (pid_ > 0 && status_ < 0) {
      kill(pid_, SIGKILL);
      wait(10s);
    }
  }
  pid_t pid() const { return pid_; }
  std::string log() const { return read_file(log_); }
  // The exit status (128 + signal when killed), or -1 if it is still running after `limit`.
  int wait(std::chrono::milliseconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (status_ < 0) {
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      } else if (std::chrono::steady_clock::now() > end) {
        return -1;
      } else {
        std::this_thread::sleep_for(20ms);
      }
    }
    return status_;
  }

 private:
  std::filesystem::path log_;
  pid_t pid_ = -1;
  int status_ = -1;
};

// Alive and not a zombie (an orphan that nobody reaped would still count as alive).
bool alive(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

// Every pid in `log` matching `pattern` (one capture group: the pid).
std::vector<pid_t> pids_in(const std::string& log, const std::string& pattern) {
  std::vector<pid_t> out;
  const std::regex re(pattern);
  for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator(); ++it) {
    out.push_back(static_cast<pid_t>(std::stol((*it)[1].str())));
  }
  return out;
}

struct NodeSetup {
  TempDir tmp;
  std::string model;
  int port = 0;       // HTTP
  std::string addr;   // --dist-init-addr
  std::string secret; // --node-secret-file of every node
  NodeSetup() {
    secret = write_secret("node.secret", "a secret every node of this test holds, 48 bytes");
    model = (tmp.path() / "tiny-k3").string();
    EXPECT_EQ(run_process({kExe, "make-random", "--arch", "kimi_k3", "--preset", "tiny", "--out", model},
                          tmp.path() / "make.log"), 0);
    port = free_tcp_port();
    addr = "127.0.0.1:" + std::to_string(free_tcp_ports(2));
  }
  std::vector<std::string> serve(std::vector<std::string> extra) const {
    std::vector<std::string> argv = {kExe, "serve", model, "--device", "cpu", "--max-model-len", "1024",
                                     "--max-num-seqs", "4", "--node-timeout", "3"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }
  std::string write_secret(const std::string& name, const std::string& text) const {
    return write_secret_file(tmp, name, text + "\n");
  }
  std::vector<std::string> node(int k, const std::vector<std::string>& extra = {}, std::string secret_file = "") const {
    if (secret_file.empty()) secret_file = secret;
    std::vector<std::string> argv = serve({"--ep", "2", "--nnodes", "2", "--node-rank", std::to_string(k),
                                           "--dist-init-addr", addr, "--node-secret-file", secret_file});
    if (k == 0) argv.insert(argv.end(), {"--port", std::to_string(port)});
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }
};

HttpResult ready(int port) { return http_request(port, "GET", "/ready", ""); }

const std::string kChat = R"({"model": "tiny-k3", "messages": [{"role": "user", "content": "Hello there"}],
                              "max_tokens": 12, "temperature": 0})";

// The assistant message of a greedy chat completion ("" on failure, with the status in `status`).
std::string chat(int port, int* status = nullptr) {
  const HttpResult r = http_request(port, "POST", "/v1/chat/completions", kChat, {}, 60000);
  if (status != nullptr) *status = r.status;
  if (r.status != 200) return "";
  return json::parse(r.body)["choices"][0]["message"].dump();
}

TEST(ServeNodes, TwoNodesServeLikeOneRankSurviveAKilledRankAndReportAGoneAgent) {
  NodeSetup s;
  // One rank's answer first.
  std::string one;
  {
    Proc single(s.serve({"--port", std::to_string(s.port)}), s.tmp.path() / "single.log");
    ASSERT_TRUE(eventually([&] { return ready(s.port).status == 200; }, 60s)) << single.log();
    one = chat(s.port);
    ASSERT_NE(one, "") << single.log();
    kill(single.pid(), SIGTERM);
    ASSERT_EQ(single.wait(30s), 0) << single.log();
  }
  auto node0 = std::make_unique<Proc>(s.node(0), s.tmp.path() / "node0.log");
  auto node1 = std::make_unique<Proc>(s.node(1), s.tmp.path() / "node1.log");
  ASSERT_TRUE(eventually([&] { return ready(s.port).status == 200; }, 60s)) << node0->log() << node1->log();
  const json r = json::parse(ready(s.port).body);
  EXPECT_EQ(r["ranks"][1]["node"], 1) << r.dump();
  EXPECT_EQ(chat(s.port), one) << "two nodes answer like one rank";

  // Bad company while it serves: another layout, and a second agent for node 1, are refused; an agent with another
  // secret is never heard; the set keeps serving.
  Proc other(s.serve({"--ep", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", s.addr,
                      "--node-secret-file", s.secret}), s.tmp.path() / "other.log");
  Proc twin(s.node(1), s.tmp.path() / "twin.log");
  Proc intruder(s.node(1, {}, s.write_secret("other.secret", std::string(40, 'x'))), s.tmp.path() / "intruder.log",
                {{"BG_RANK_TIMEOUT_S", "3"}});
  EXPECT_EQ(other.wait(20s), 1);
  EXPECT_NE(other.log().find("node 0 refused this node: node 1 was started with 'dp=4"), std::string::npos)
      << other.log();
  EXPECT_EQ(twin.wait(20s), 1);
  EXPECT_NE(twin.log().find("node rank 1 is already taken by the agent pid " + std::to_string(node1->pid())),
            std::string::npos) << twin.log();
  EXPECT_EQ(intruder.wait(20s), 1);
  EXPECT_NE(intruder.log().find("node 0 did not answer at tcp://" + s.addr + " within 3 s"), std::string::npos)
      << intruder.log();
  EXPECT_NE(intruder.log().find("Does node 0 use the same --node-secret-file"), std::string::npos);
  EXPECT_EQ(node0->log().find("pid " + std::to_string(intruder.pid()) + " on"), std::string::npos)
      << "node 0 heard the intruder";
  EXPECT_EQ(ready(s.port).status, 200);

  // kill -9 of the remote rank, with a request in flight: 503, /ready names rank 1 on node 1, the set comes back.
  const std::vector<pid_t> first_set = {pids_in(node0->log(), R"(started rank 0 \(pid (\d+)\))").at(0),
                                        pids_in(node1->log(), R"(started rank 1 \(pid (\d+)\))").at(0)};
  auto in_flight = std::async(std::launch::async, [&] {
    return http_request(s.port, "POST", "/v1/completions",
                        R"({"model": "tiny-k3", "prompt": "Tell me a long story", "max_tokens": 900,
                            "temperature": 0, "ignore_eos": true})", {}, 60000).status;
  });
  std::this_thread::sleep_for(300ms);
  kill(first_set[1], SIGKILL);
  EXPECT_EQ(in_flight.get(), 503);
  std::string why;
  EXPECT_TRUE(eventually([&] {
    const HttpResult h = ready(s.port);
    why = h.body;
    return h.status == 503 && h.body.find("rank 1 (node 1) the worker process was killed by signal 9") !=
                                  std::string::npos;
  }, 10s)) << why;
  EXPECT_TRUE(eventually([&] { return !alive(first_set[0]) && !alive(first_set[1]); }, 20s));
  ASSERT_TRUE(eventually([&] { return ready(s.port).status == 200; }, 60s)) << node0->log();
  EXPECT_EQ(chat(s.port), one) << "the restarted set answers the same";

  // kill -9 of node 1's agent: node 0 reports it at once, its rank dies with it, and node 0's old rank is reaped.
  const pid_t rank0 = pids_in(node0->log(), R"(started rank 0 \(pid (\d+)\))").back();
  const pid_t rank1 = pids_in(node1->log(), R"(started rank 1 \(pid (\d+)\))").back();
  kill(node1->pid(), SIGKILL);
  EXPECT_EQ(node1->wait(5s), 128 + SIGKILL);
  EXPECT_TRUE(eventually([&] {
    return node0->log().find("node 1: its agent (pid " + std::to_string(node1->pid()) + " on") != std::string::npos;
  }, 3s)) << node0->log();
  EXPECT_TRUE(eventually([&] {
    return ready(s.port).body.find("node 1 has no agent (its agent (pid " + std::to_string(node1->pid())) !=
           std::string::npos;
  }, 10s)) << ready(s.port).body;
  EXPECT_TRUE(eventually([&] { return !alive(rank0) && !alive(rank1); }, 20s)) << "an orphan rank is left";

  // A new agent for node 1: the set is back; SIGTERM to node 0 ends both nodes cleanly, with nothing left behind.
  node1 = std::make_unique<Proc>(s.node(1), s.tmp.path() / "node1b.log");
  ASSERT_TRUE(eventually([&] { return ready(s.port).status == 200; }, 60s)) << node0->log() << node1->log();
  EXPECT_EQ(chat(s.port), one);
  const std::vector<pid_t> last_set = {pids_in(node0->log(), R"(started rank 0 \(pid (\d+)\))").back(),
                                       pids_in(node1->log(), R"(started rank 1 \(pid (\d+)\))").back()};
  kill(node0->pid(), SIGTERM);
  EXPECT_EQ(node0->wait(30s), 0) << node0->log();
  EXPECT_EQ(node1->wait(15s), 0) << node1->log();
  EXPECT_NE(node1->log().find("node 0 says goodbye"), std::string::npos);
  EXPECT_FALSE(alive(last_set[0]) || alive(last_set[1]));
}

// kill -9 of node 0: its own rank dies with it, and node 1's agent stops its rank after --node-timeout and waits;
// node 0 started again takes node 1 back (same answer); killed again and not restarted, the agent exits 1 after the
// rank timeout.
TEST(ServeNodes, AnAgentWhoseNodeZeroIsGoneStopsItsRanksAndRejoinsARestartedOne) {
  NodeSetup s;
  const std::vector<std::pair<std::string, std::string>> rejoin_timeout = {{"BG_RANK_TIMEOUT_S", "12"}};
  auto node0 = std::make_unique<Proc>(s.node(0), s.tmp.path() / "node0.log");
  Proc node1(s.node(1), s.tmp.path() / "node1.log", rejoin_timeout);
  ASSERT_TRUE(eventually([&] { return ready(s.port).status == 200; }, 60s)) << node0->log() << node1.log();
  const std::string answer = chat(s.port);
  ASSERT_NE(answer, "");
  const std::vector<pid_t> ranks = {pids_in(node0->log(), R"(started rank 0 \(pid (\d+)\))").at(0),
                                    pids_in(node1.log(), R"(started rank 1 \(pid (\d+)\))").at(0)};
  const auto t0 = std::chrono::steady_clock::now();
  kill(node0->pid(), SIGKILL);
  EXPECT_EQ(node0->wait(10s), 128 + SIGKILL);
  const std::string lost = "node 1: node 0 (tcp://" + s.addr + ") sent nothing for 3.0 s (--node-timeout); this "
                           "node's ranks were stopped; waiting up to 12 s (BG_RANK_TIMEOUT_S) for node 0 to come back";
  ASSERT_TRUE(eventually([&] { return node1.log().find(lost) != std::string::npos; }, 10s)) << node1.log();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_TRUE(eventually([&] { return !alive(ranks[0]) && !alive(ranks[1]); }, 10s)) << "an orphan rank is left";
  EXPECT_TRUE(alive(node1.pid()));  // the agent waits

  node0 = std::make_unique<Proc>(s.node(0), s.tmp.path() / "node0-again.log");
  ASSERT_TRUE(eventually([&] { return ready(s.port).status == 200; }, 60s)) << node0->log() << node1.log();
  EXPECT_EQ(chat(s.port), answer);
  const std::vector<pid_t> again = pids_in(node1.log(), R"(started rank 1 \(pid (\d+)\))");
  ASSERT_EQ(again.size(), 2u) << node1.log();

  kill(node0->pid(), SIGKILL);  // and this time node 0 stays away
  EXPECT_EQ(node1.wait(40s), 1) << node1.log();
  EXPECT_NE(node1.log().find("node 0 did not come back at tcp://" + s.addr + " within 12 s"), std::string::npos)
      << node1.log();
  EXPECT_TRUE(eventually([&] { return !alive(again[1]); }, 10s)) << "an orphan rank is left";
}

TEST(ServeNodes, ANodeThatNeverComesAndAnUnreachableNodeZeroAreNamed) {
  NodeSetup s;
  const std::vector<std::pair<std::string, std::string>> short_timeout = {{"BG_RANK_TIMEOUT_S", "3"}};
  // Node 0 alone: serve exits 1 naming node 1 once the rank timeout has passed.
  Proc node0(s.node(0), s.tmp.path() / "node0.log", short_timeout);
  EXPECT_EQ(node0.wait(30s), 1) << node0.log();
  EXPECT_NE(node0.log().find("worker failed before it was ready: rank 1 (node 1): node 1 has not connected"),
            std::string::npos) << node0.log();
  // Node 1 alone: node 0 never answers.
  Proc node1(s.node(1), s.tmp.path() / "node1.log", {{"BG_RANK_TIMEOUT_S", "2"}});
  EXPECT_EQ(node1.wait(30s), 1) << node1.log();
  EXPECT_NE(node1.log().find("node 0 did not answer at tcp://" + s.addr + " within 2 s"), std::string::npos)
      << node1.log();
  // A name that does not resolve: an error at once.
  std::vector<std::string> argv = s.node(1);
  argv[std::find(argv.begin(), argv.end(), s.addr) - argv.begin()] = "no-such-host.invalid:29500";
  Proc bad(argv, s.tmp.path() / "bad.log");
  EXPECT_EQ(bad.wait(20s), 1);
  EXPECT_NE(bad.log().find("cannot resolve 'no-such-host.invalid'"), std::string::npos) << bad.log();
}

}  // namespace
}  // namespace bg::testing
