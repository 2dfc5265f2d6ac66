// What the frontend trusts from workers and how it supervises them: exact routing ids (a former incarnation or an
// impostor is ignored), token events only from the rank that owns the request, heartbeat deadlines, failing every
// in-flight request on a restart; the supervisor's start failures (a worker that exits or never connects); the sweep
// of stale IPC directories.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <mutex>
#include <thread>

#include "fake_worker.h"
#include "process_testing.h"
#include "server/frontend/ipc_dir.h"
#include "server/frontend/worker_link.h"
#include "server/frontend/worker_manager.h"
#include "temp_dir.h"

namespace bg::frontend {
namespace {

using namespace std::chrono_literals;
using bg::testing::eventually;

std::string endpoint() {
  static int n = 0;
  return "inproc://supervision-test-" + std::to_string(n++);
}

// A DEALER that speaks for whoever its routing id says (the test drives it from its own thread).
class Impostor {
 public:
  Impostor(zmq::context_t& ctx, const std::string& ep, const std::string& identity) : sock_(ctx, zmq::socket_type::dealer) {
    sock_.set(zmq::sockopt::routing_id, identity);
    sock_.set(zmq::sockopt::linger, 0);
    sock_.connect(ep);
  }
  void send(const std::string& type, const nlohmann::json& body) {
    const std::string f = proto::encode(type, body);
    sock_.send(zmq::buffer(f), zmq::send_flags::none);
  }
  void ready_status(int32_t rank) {
    proto::WorkerStatus st;
    st.rank = rank;
    st.phase = "ready";
    st.max_model_len = 64;
    send("status", st);
  }

 private:
  zmq::socket_t sock_;
};

TEST(WorkerLinkTrust, OnlyTheCurrentIncarnationsRoutingIdIsAccepted) {
  zmq::context_t ctx;
  const std::string ep = endpoint();
  WorkerLink link(ctx, ep, 1);
  link.start();
  link.begin_incarnation(0, "rank-0-i2", 1234);
  Impostor old_one(ctx, ep, "rank-0-i1"), near_miss(ctx, ep, "rank-0-i2x"), padded(ctx, ep, "rank-00");
  old_one.ready_status(0);
  near_miss.ready_status(0);
  padded.ready_status(0);
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(link.ranks()[0].connected);
  Impostor current(ctx, ep, "rank-0-i2");
  current.ready_status(1);  // the right id claiming the wrong rank
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(link.ranks()[0].connected);
  current.ready_status(0);
  EXPECT_TRUE(eventually([&] { return link.all_ready(); }));
  EXPECT_EQ(link.ranks()[0].pid, 1234);
  link.stop();
}

TEST(WorkerLinkTrust, TokenEventsCountOnlyFromTheRankThatOwnsTheRequest) {
  zmq::context_t ctx;
  const std::string ep = endpoint();
  WorkerLink link(ctx, ep, 2, /*tp=*/2);  // one DP group of two ranks: its leader, rank 0, takes every request
  link.start();
  bg::testing::FakeWorker rank0(ctx, ep, [](const proto::GenerateRequest&) { return std::vector<int32_t>{'a', 'b'}; },
                                64, 261, "rank-0", 0);
  rank0.token_delay_ms = 300;
  Impostor rank1(ctx, ep, "rank-1");  // connected and ready (a rank set steps together), but owns no request
  rank1.ready_status(1);
  ASSERT_TRUE(eventually([&] { return link.all_ready(); }));
  proto::GenerateRequest req;
  req.id = "req-1";
  req.prompt = {1, 2};
  req.params.max_tokens = 2;
  auto events = link.submit(req);
  proto::TokenEvent forged;
  forged.id = "req-1";
  forged.tokens = {99};
  forged.finish_reason = "stop";
  rank1.send("tokens", forged);
  std::vector<int32_t> got;
  for (int i = 0; i < 50 && (got.empty() || got.back() != 'b'); ++i) {
    if (auto ev = events->pop(100ms)) got.insert(got.end(), ev->tokens.begin(), ev->tokens.end());
  }
  EXPECT_EQ(got, (std::vector<int32_t>{'a', 'b'}));
  link.stop();
}

TEST(WorkerLinkTrust, HeartbeatDeadlineMakesARankNotReady) {
  zmq::context_t ctx;
  const std::string ep = endpoint();
  WorkerLink link(ctx, ep, 1);
  link.set_heartbeat_timeout(300ms);
  link.start();
  bg::testing::FakeWorker w(ctx, ep, [](const proto::GenerateRequest&) { return std::vector<int32_t>{'a'}; });
  ASSERT_TRUE(eventually([&] { return link.all_ready(); }));
  w.paused = true;  // a stopped process sends nothing
  ASSERT_TRUE(eventually([&] { return !link.all_ready(); }));
  const RankState s = link.ranks()[0];
  EXPECT_EQ(s.state(), "hung");
  EXPECT_NE(s.not_ready_reason().find("stopped responding"), std::string::npos) << s.not_ready_reason();
  w.paused = false;
  EXPECT_TRUE(eventually([&] { return link.all_ready(); }));
  link.stop();
}

TEST(WorkerLinkTrust, FailAllEndsEveryRequestWithItsReason) {
  zmq::context_t ctx;
  const std::string ep = endpoint();
  WorkerLink link(ctx, ep, 1);
  link.start();
  bg::testing::FakeWorker w(ctx, ep, [](const proto::GenerateRequest&) { return std::vector<int32_t>(100, 'a'); });
  w.token_delay_ms = 1000;
  ASSERT_TRUE(eventually([&] { return link.all_ready(); }));
  proto::GenerateRequest req;
  req.prompt = {1};
  req.params.max_tokens = 100;
  req.id = "a";
  auto ea = link.submit(req);
  req.id = "b";
  auto eb = link.submit(req);
  EXPECT_EQ(link.n_in_flight(), 2u);
  link.fail_all("rank 0: restarting", 503);
  for (auto* e : {&ea, &eb}) {
    std::optional<proto::TokenEvent> ev;
    while ((ev = (*e)->pop(1000ms)) && ev->finish_reason.empty()) {
    }
    ASSERT_TRUE(ev);
    EXPECT_EQ(ev->finish_reason, "error");
    EXPECT_EQ(ev->error_code, 503);
    EXPECT_EQ(ev->error, "rank 0: restarting");
  }
  EXPECT_EQ(link.n_in_flight(), 0u);
  link.stop();
}

TEST(Supervisor, AWorkerThatExitsBeforeReadyFailsTheStartWithItsStatus) {
  zmq::context_t ctx;
  WorkerLink link(ctx, endpoint(), 1);
  link.start();
  WorkerManager m(link, 1, [](int32_t, const std::string&) {
    return std::vector<std::string>{"/bin/sh", "-c", "exit 3"};
  });
  m.start();
  EXPECT_EQ(m.wait_change(WorkerManager::Phase::starting, 5000ms), WorkerManager::Phase::failed_at_start);
  EXPECT_NE(m.failure().find("exited with status 3"), std::string::npos) << m.failure();
  m.stop(1000ms);
  link.stop();
}

TEST(Supervisor, AWorkerThatNeverConnectsIsKilledAfterTheDeadline) {
  zmq::context_t ctx;
  WorkerLink link(ctx, endpoint(), 1);
  link.start();
  SupervisorConfig cfg;
  cfg.heartbeat_timeout = 400ms;
  WorkerManager m(link, 1, [](int32_t, const std::string&) {
    return std::vector<std::string>{"/bin/sleep", "30"};
  }, cfg);
  m.start();
  const int64_t pid = link.ranks()[0].pid;
  ASSERT_GT(pid, 0);
  EXPECT_EQ(m.wait_change(WorkerManager::Phase::starting, 5000ms), WorkerManager::Phase::failed_at_start);
  EXPECT_NE(m.failure().find("did not connect"), std::string::npos) << m.failure();
  EXPECT_NE(kill(static_cast<pid_t>(pid), 0), 0) << "the hung process is killed and reaped";
  m.stop(1000ms);
  link.stop();
}

// Rank 1 on "node 1", whose agent the test plays: what it reports is what the supervisor sees.
class FakeRemote final : public RemoteRanks {
 public:
  bool is_remote(int32_t rank) const override { return rank == 1; }
  int32_t node_of(int32_t rank) const override { return rank; }
  void start(int64_t incarnation, const std::vector<std::string>& identities) override {
    std::lock_guard lock(mu_);
    started_ = incarnation;
    identity_ = identities.at(1);
  }
  void kill(int64_t incarnation) override {
    std::lock_guard lock(mu_);
    killed_ = incarnation;
    report_.exited = report_.started;  // an agent reaps what it started
    report_.wait_status = SIGKILL;
  }
  RemoteRank state(int32_t, int64_t incarnation) const override {
    std::lock_guard lock(mu_);
    RemoteRank s = report_;
    s.node = 1;
    s.started = s.started && incarnation == started_;
    return s;
  }
  void report(const RemoteRank& r) {
    std::lock_guard lock(mu_);
    report_ = r;
  }
  int64_t started() const {
    std::lock_guard lock(mu_);
    return started_;
  }
  int64_t killed() const {
    std::lock_guard lock(mu_);
    return killed_;
  }
  std::string identity() const {
    std::lock_guard lock(mu_);
    return identity_;
  }

 private:
  mutable std::mutex mu_;
  RemoteRank report_;
  int64_t started_ = 0, killed_ = 0;
  std::string identity_;
};

// Rank 0 runs here (a process that never connects, with a long heartbeat deadline); rank 1 is remote.
struct RemoteSet {
  zmq::context_t ctx;
  WorkerLink link{ctx, endpoint(), 2};
  FakeRemote remote;
  std::vector<int32_t> spawned;
  std::unique_ptr<WorkerManager> m;
  explicit RemoteSet(std::chrono::milliseconds node_join_timeout) {
    link.start();
    link.set_ranks_per_node(1);
    SupervisorConfig cfg;
    cfg.node_join_timeout = node_join_timeout;
    cfg.identity_suffix = "-5eed";
    m = std::make_unique<WorkerManager>(link, 2, [this](int32_t rank, const std::string&) {
      spawned.push_back(rank);
      return std::vector<std::string>{"/bin/sleep", "30"};
    }, cfg, &remote);
  }
  ~RemoteSet() {
    m->stop(1000ms);
    link.stop();
  }
};

TEST(Supervisor, ARemoteRankIsStartedByItsAgentAndItsDeathFailsTheSet) {
  RemoteSet set(60'000ms);
  set.m->start();
  EXPECT_EQ(set.spawned, std::vector<int32_t>{0}) << "only the local rank is forked here";
  EXPECT_EQ(set.remote.started(), 1);
  EXPECT_EQ(set.remote.identity(), "rank-1-i1-5eed");
  RemoteRank r;
  r.started = true;
  r.pid = 4321;
  set.remote.report(r);
  EXPECT_TRUE(eventually([&] { return set.link.ranks()[1].pid == 4321; }));
  const int64_t local_pid = set.link.ranks()[0].pid;
  r.exited = true;
  r.wait_status = SIGKILL;
  set.remote.report(r);
  EXPECT_EQ(set.m->wait_change(WorkerManager::Phase::starting, 5000ms), WorkerManager::Phase::failed_at_start);
  EXPECT_EQ(set.m->failure(), "rank 1 (node 1): the worker process was killed by signal 9 (Killed)");
  EXPECT_NE(kill(static_cast<pid_t>(local_pid), 0), 0) << "the local rank is killed and reaped with the set";
  EXPECT_EQ(set.link.ranks()[0].exit_reason, "stopped with the worker set (rank 1 (node 1) the worker process was "
                                             "killed by signal 9 (Killed))");
}

TEST(Supervisor, ANodeThatNeverComesIsNamedAfterTheJoinTimeout) {
  RemoteSet set(500ms);
  RemoteRank r;
  r.waiting = "node 1 has not connected";
  set.remote.report(r);
  set.m->start();
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(set.m->phase(), WorkerManager::Phase::starting);
  EXPECT_NE(set.link.ranks()[1].not_ready_reason().find("node 1 has not connected"), std::string::npos)
      << set.link.ranks()[1].not_ready_reason();
  EXPECT_EQ(set.m->wait_change(WorkerManager::Phase::starting, 5000ms), WorkerManager::Phase::failed_at_start);
  EXPECT_EQ(set.m->failure(), "rank 1 (node 1): node 1 has not connected for 0.5 s (BG_RANK_TIMEOUT_S)");
  EXPECT_EQ(set.remote.killed(), 1) << "killed anyway: an agent that comes late is not sent a dead incarnation";
}

TEST(IpcDirSweep, RemovesDirectoriesOfGoneProcessesOnly) {
  bg::testing::TempDir tmp;
  // A process that is gone: a child that exited and was reaped.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  const auto dead = tmp / "batchgen-serve-dead01";
  std::filesystem::create_directories(dead);
  std::ofstream(dead / "owner") << child << " 12345\n";
  // This process, with the right and with a wrong start time (a reused pid).
  const auto alive = tmp / "batchgen-serve-alive1";
  std::filesystem::create_directories(alive);
  std::ofstream(alive / "owner") << getpid() << ' ' << process_start_time(getpid()) << '\n';
  const auto reused = tmp / "batchgen-serve-reuse1";
  std::filesystem::create_directories(reused);
  std::ofstream(reused / "owner") << getpid() << ' ' << process_start_time(getpid()) + 1 << '\n';
  // Without an owner file (an older serve): removed only when old and its socket is dead.
  const auto old_unowned = tmp / "batchgen-serve-old001";
  std::filesystem::create_directories(old_unowned);
  std::filesystem::last_write_time(old_unowned, std::filesystem::file_time_type::clock::now() - std::chrono::hours(2));
  const auto new_unowned = tmp / "batchgen-serve-new001";
  std::filesystem::create_directories(new_unowned);
  const auto other = tmp / "something-else";
  std::filesystem::create_directories(other);
  IpcDir mine(tmp.path());

  EXPECT_EQ(sweep_stale_ipc_dirs(tmp.path()), 3u);
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_FALSE(std::filesystem::exists(reused));
  EXPECT_FALSE(std::filesystem::exists(old_unowned));
  EXPECT_TRUE(std::filesystem::exists(alive));
  EXPECT_TRUE(std::filesystem::exists(new_unowned));
  EXPECT_TRUE(std::filesystem::exists(other));
  EXPECT_TRUE(std::filesystem::exists(mine.path()));
}

}  // namespace
}  // namespace bg::frontend
