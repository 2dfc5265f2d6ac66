// weightd in-process: status, attach / detach counting, shutdown, a second daemon of the same name, attaching with the
// wrong model, and the engine reading through --weight-store computing exactly what it computes from the files (every
// golden case within the golden tolerance).
#include <gtest/gtest.h>

#include "engine/worker.h"
#include "golden/golden_runner.h"
#include "server/frontend/serve.h"
#include "model/model_testing.h"
#include "weights/open_source.h"
#include "weights/store_source.h"
#include "store_checks.h"
#include "weights_testing.h"

namespace bg::testing {
namespace {

using namespace bg::weights;

TEST(Daemon, StatusAttachDetachAndShutdown) {
  StoreGuard g;
  const auto model = golden_model("deepseek_v3/tiny-fp8");
  InProcessDaemon d(daemon_options(model, g.name()));
  ASSERT_EQ(d.wait_ready(), "");
  nlohmann::json st = store_status(g.name());
  EXPECT_EQ(st["phase"], "ready");
  EXPECT_EQ(st["origin"], "loaded");
  EXPECT_EQ(st["loaded"], true);
  EXPECT_EQ(st["adopted"], false);
  EXPECT_EQ(st["clients"], 0);
  EXPECT_EQ(st["layout_version"], kStoreLayoutVersion);
  EXPECT_GT(st["tensors"].get<int64_t>(), 100);
  EXPECT_GT(st["expert_blocks"].get<int64_t>(), 0);
  EXPECT_GE(st["segments"].get<int64_t>(), 1);
  EXPECT_EQ(st["pid"], ::getpid());
  {
    auto a = open_weight_source(model, {g.name(), ""});
    auto b = attach_store(g.name(), model, 10);
    EXPECT_EQ(store_status(g.name())["clients"], 2);
    EXPECT_NE(a->describe().find(g.name()), std::string::npos);
  }
  EXPECT_EQ(store_status(g.name())["clients"], 0);
  auto bad = control_request(g.name(), {{"cmd", "frobnicate"}});
  EXPECT_EQ(bad["ok"], false);
  EXPECT_NE(bad["error"].get<std::string>().find("unknown command"), std::string::npos);
  {
    InProcessDaemon second(daemon_options(model, g.name()));
    EXPECT_NE(second.wait_ready().find("already running"), std::string::npos);
  }
  EXPECT_EQ(store_status(g.name())["phase"], "ready") << "the first daemon is untouched";
  auto reply = control_request(g.name(), {{"cmd", "shutdown"}});
  EXPECT_EQ(reply["ok"], true);
  d.stop(true);
  EXPECT_EQ(d.rc(), 0);
  EXPECT_TRUE(list_store_shm(g.name()).empty());
  EXPECT_NE(bg_error_of([&] { store_status(g.name()); }).find("no weight daemon named"), std::string::npos);
}

TEST(Control, PeerCredentialsComeFromTheKernelAddress) {
  auto c = parse_peer_address("localhost:1000:1001:4242");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->uid, 1000u);
  EXPECT_EQ(c->gid, 1001u);
  EXPECT_EQ(c->pid, 4242);
  EXPECT_TRUE(parse_peer_address(":0:0:7").has_value());
  EXPECT_FALSE(parse_peer_address(nullptr).has_value());
  EXPECT_FALSE(parse_peer_address("127.0.0.1:5555").has_value());
  EXPECT_FALSE(parse_peer_address("x:1:2:notapid").has_value());
  EXPECT_EQ(process_start_ticks(::getpid()), process_start_ticks(::getpid()));
  EXPECT_GT(process_start_ticks(::getpid()), 0u);
  EXPECT_EQ(process_start_ticks(0x7ffffff0), 0u);
}

TEST(Daemon, AttachingWithAnotherModelIsRefused) {
  StoreGuard g;
  InProcessDaemon d(daemon_options(golden_model("deepseek_v3/tiny-fp8"), g.name()));
  ASSERT_EQ(d.wait_ready(), "");
  EXPECT_NE(bg_error_of([&] { load_model(golden_model("deepseek_v3/tiny-fp32"), load_options(g.name())); })
                .find("holds another model"),
            std::string::npos);
  EXPECT_NE(bg_error_of([&] { load_model(golden_model("deepseek_v3/tiny-fp8"), load_options("nosuch")); })
                .find("no weight daemon named 'nosuch'"),
            std::string::npos);
}

TEST(Daemon, FailedLoadIsReportedAndLeavesNothing) {
  StoreGuard g;
  TempDir tmp;
  std::filesystem::copy(golden_model("deepseek_v3/tiny-fp8"), tmp.path());
  std::filesystem::permissions(tmp / "model-00002-of-00002.safetensors", std::filesystem::perms::owner_all);
  std::filesystem::resize_file(tmp / "model-00002-of-00002.safetensors", 1000);  // truncated shard
  InProcessDaemon d(daemon_options(tmp.path(), g.name()));
  EXPECT_NE(d.wait_ready().find("model-00002-of-00002.safetensors"), std::string::npos);
  d.stop(true);
  EXPECT_EQ(d.rc(), 1);
  EXPECT_TRUE(list_store_shm(g.name()).empty());
}

// `serve --weight-store NAME` hands the flag to its workers, and a worker's engine attaches through it.
TEST(Daemon, ServeWorkersAttachThroughTheStore) {
  StoreGuard g;
  const auto model = golden_model("deepseek_v3/tiny-fp8");
  InProcessDaemon d(daemon_options(model, g.name()));
  ASSERT_EQ(d.wait_ready(), "");
  frontend::ServeOptions so;
  so.model_dir = model.string();
  so.weight_store = g.name();
  const auto argv = frontend::worker_command(so, "batchgen", "ipc:///tmp/x", 0, "rank-0-i0");
  auto it = std::find(argv.begin(), argv.end(), "--weight-store");
  ASSERT_NE(it, argv.end());
  EXPECT_EQ(*(it + 1), g.name());
  EXPECT_EQ(std::find(argv.begin(), argv.end(), "--distributed-weight-config"), argv.end());
  engine::WorkerOptions wo;
  wo.model_dir = model;
  wo.weight_store = g.name();
  wo.endpoint = "inproc://unused";  // load_engine checks the flags; nothing connects here
  auto engine = engine::load_engine(wo);
  EXPECT_EQ(store_status(g.name())["clients"], 1);
  engine.reset();
  EXPECT_EQ(store_status(g.name())["clients"], 0);
  so.weight_store = "bad/name";
  EXPECT_NE(bg_error_of([&] { frontend::validate_serve_options(so); }).find("only letters"), std::string::npos);
}

class GoldenThroughStore : public ::testing::TestWithParam<std::string> {};

// Every golden case read through --weight-store gives the reference logits (CPU, within 1e-4) and the very same
// logits as the files read directly.
TEST_P(GoldenThroughStore, MatchesReferenceAndDirectRead) {
  StoreGuard g;
  InProcessDaemon d(daemon_options(golden_model(GetParam()), g.name()));
  ASSERT_EQ(d.wait_ready(), "");
  check_golden_through_store(GetParam(), g.name(), {1.0});
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenThroughStore,
                         ::testing::Values("deepseek_v3/tiny-fp32", "deepseek_v3/tiny-fp8", "deepseek_v3/tiny-mxfp4",
                                           "kimi_k3/k3-tiny", "kimi_k3/k3-tiny-long"),
                         [](const auto& param_info) { return golden_case_test_name(param_info.param); });

}  // namespace
}  // namespace bg::testing
