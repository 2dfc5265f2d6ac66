// The weight store's lifecycle through the CLI, as a user runs it: `weightd start` (returns once ready), an engine
// attached and killed with SIGKILL then run again (no reload, the same logits), the daemon killed with SIGKILL and
// started again (it adopts the segments), a corrupt segment (refused with a clear error, or re-read), `weightd stop`.
#include <gtest/gtest.h>

#include "model/model_testing.h"
#include "weights/store_source.h"
#include "weights_testing.h"

namespace bg::testing {
namespace {

using namespace bg::weights;
using json = nlohmann::json;

json start_daemon(const std::filesystem::path& model, const std::string& name, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"weightd", "start", "--model", model.string(), "--name", name};
  args.insert(args.end(), extra.begin(), extra.end());
  const CmdResult r = run_batchgen(args);
  EXPECT_EQ(r.rc, 0) << r.err;
  json j = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_TRUE(j.is_object()) << r.out << r.err;
  return j.is_object() ? j : json::object();
}

TEST(Lifecycle, EngineAndDaemonRestartsNeedNoReload) {
  StoreGuard g;
  const auto model = golden_model("kimi_k3/k3-tiny");
  const std::vector<float> direct = score_logits(model, {});
  ASSERT_FALSE(direct.empty());
  json st = start_daemon(model, g.name());
  EXPECT_EQ(st["phase"], "ready");
  EXPECT_EQ(st["origin"], "loaded");
  const std::string generation = st.value("generation", std::string());

  // An engine attaches, then dies by SIGKILL: its attach is no longer counted.
  TempDir tmp;
  const pid_t engine = spawn_batchgen({"generate", "--model", model.string(), "--weight-store", g.name(),
                                       "--prompt-ids", "1,2,3", "--max-tokens", "4000", "--ignore-eos"},
                                      tmp / "out", tmp / "err");
  ASSERT_TRUE(wait_for([&] { return store_status(g.name())["clients"] == 1; }, 60000)) << read_file(tmp / "err");
  ::kill(engine, SIGKILL);
  int status = 0;
  ::waitpid(engine, &status, 0);
  EXPECT_TRUE(wait_for([&] { return store_status(g.name())["clients"] == 0; }, 5000));

  // The engine again: the same logits, from the same store (same generation, never reloaded).
  EXPECT_EQ(score_logits(model, {"--weight-store", g.name()}), direct);
  st = store_status(g.name());
  EXPECT_EQ(st["generation"], generation);
  EXPECT_EQ(st["origin"], "loaded");

  // The daemon dies by SIGKILL; the store stays; a new daemon adopts it after verifying every checksum.
  g.kill_daemon();
  EXPECT_FALSE(list_store_shm(g.name()).empty());
  st = start_daemon(model, g.name());
  EXPECT_EQ(st["origin"], "adopted");
  EXPECT_EQ(st["adopted"], true);
  EXPECT_EQ(st["generation"], generation);
  EXPECT_EQ(st["repaired_tensors"].size(), 0u);
  EXPECT_EQ(score_logits(model, {"--weight-store", g.name()}), direct);

  const CmdResult stop = run_batchgen({"weightd", "stop", "--name", g.name()});
  EXPECT_EQ(stop.rc, 0) << stop.err;
  EXPECT_TRUE(list_store_shm(g.name()).empty());
  const CmdResult gone = run_batchgen({"weightd", "status", "--name", g.name()});
  EXPECT_NE(gone.rc, 0);
  EXPECT_NE(gone.err.find("no weight daemon named"), std::string::npos) << gone.err;
}

TEST(Lifecycle, CorruptSegmentIsRefusedOrReloaded) {
  StoreGuard g;
  const auto model = golden_model("deepseek_v3/tiny-fp8");
  const std::vector<float> direct = score_logits(model, {});
  start_daemon(model, g.name());
  g.kill_daemon();
  const std::string victim = "model.layers.2.mlp.experts.11.up_proj.weight";
  {
    auto src = StoreSource::open_shm(g.name(), 0);
    const TensorInfo& t = src->manifest().tensors[src->manifest().by_name.at(victim)];
    MappedSegment seg = MappedSegment::open_shm(shm_segment_name(g.name(), t.segment), /*writable=*/true);
    seg.data()[t.offset + t.bytes / 2] ^= std::byte{0x10};
  }
  const CmdResult refused = run_batchgen({"weightd", "start", "--model", model.string(), "--name", g.name(),
                                          "--on-corrupt", "refuse"});
  EXPECT_NE(refused.rc, 0);
  EXPECT_NE(refused.err.find("no longer match their checksums"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find(victim), std::string::npos) << refused.err;
  EXPECT_FALSE(list_store_shm(g.name()).empty()) << "a refused store is left as it is";

  const json st = start_daemon(model, g.name());
  EXPECT_EQ(st["origin"], "adopted");
  ASSERT_EQ(st["repaired_tensors"].size(), 1u) << st.dump();
  EXPECT_EQ(st["repaired_tensors"][0], victim);
  EXPECT_EQ(score_logits(model, {"--weight-store", g.name()}), direct);
}

// The same lifecycle with the experts in the GPU kernel's layout (--expert-layout w4a16): engines get the same logits,
// a restarted daemon adopts the store when asked for the same layout and rebuilds it when asked for another.
TEST(Lifecycle, W4a16ExpertLayoutIsAdoptedOrRebuiltAsAsked) {
  StoreGuard g;
  const auto model = golden_model("deepseek_v3/tiny-mxfp4");
  const std::vector<float> direct = score_logits(model, {});
  json st = start_daemon(model, g.name(), {"--expert-layout", "w4a16"});
  EXPECT_EQ(st["expert_layout"], "w4a16");
  EXPECT_GT(st.value("w4a16_blocks", 0), 0);
  const std::string generation = st.value("generation", std::string());
  EXPECT_EQ(score_logits(model, {"--weight-store", g.name()}), direct);
  // An expert-parallel rank set attached to it (each rank unpacks only its own experts), all resident or streaming.
  EXPECT_EQ(score_logits(model, {"--weight-store", g.name(), "--ep", "2"}), direct);
  EXPECT_EQ(score_logits(model, {"--weight-store", g.name(), "--ep", "2", "--resident-experts", "0.5"}), direct);
  g.kill_daemon();
  st = start_daemon(model, g.name(), {"--expert-layout", "w4a16"});
  EXPECT_EQ(st["origin"], "adopted");
  EXPECT_EQ(st["generation"], generation);
  g.kill_daemon();
  st = start_daemon(model, g.name());
  EXPECT_EQ(st["origin"], "loaded");
  EXPECT_EQ(st["expert_layout"], "checkpoint");
  EXPECT_EQ(st["w4a16_blocks"], 0);
  EXPECT_EQ(score_logits(model, {"--weight-store", g.name()}), direct);
  const CmdResult bad = run_batchgen({"weightd", "start", "--model", model.string(), "--name", g.name() + "x",
                                      "--expert-layout", "fp4"});
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.err.find("--expert-layout"), std::string::npos) << bad.err;
}

TEST(Lifecycle, StopWithoutDaemonRemovesLeftoversAndBadInputIsAClearError) {
  StoreGuard g;
  const auto model = golden_model("deepseek_v3/tiny-fp8");
  start_daemon(model, g.name(), {"--segment-gb", "0.001", "--reader", "pread", "--no-direct"});
  const CmdResult again = run_batchgen({"weightd", "start", "--model", model.string(), "--name", g.name()});
  EXPECT_NE(again.rc, 0);
  EXPECT_NE(again.err.find("already running"), std::string::npos) << again.err;
  g.kill_daemon();
  const CmdResult stop = run_batchgen({"weightd", "stop", "--name", g.name()});
  EXPECT_EQ(stop.rc, 0) << stop.err;
  EXPECT_NE(stop.err.find("leftover"), std::string::npos) << stop.err;
  EXPECT_TRUE(list_store_shm(g.name()).empty());
  const CmdResult none = run_batchgen({"weightd", "stop", "--name", g.name()});
  EXPECT_NE(none.rc, 0);
  EXPECT_NE(none.err.find("no weight store named"), std::string::npos) << none.err;
  const CmdResult bad_name = run_batchgen({"weightd", "start", "--model", model.string(), "--name", "a/b"});
  EXPECT_NE(bad_name.rc, 0);
  EXPECT_NE(bad_name.err.find("only letters"), std::string::npos) << bad_name.err;
  const CmdResult no_daemon = run_batchgen({"generate", "--model", model.string(), "--weight-store", g.name(),
                                            "--prompt-ids", "1,2"});
  EXPECT_NE(no_daemon.rc, 0);
  EXPECT_NE(no_daemon.err.find("weightd start"), std::string::npos) << no_daemon.err;
}

}  // namespace
}  // namespace bg::testing
