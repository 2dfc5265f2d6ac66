// `batchgen score` with several CPU rank processes (--ep / --tp / --dp layouts) against one rank, on every golden case
// and prompt: each logit row within 1e-4 of the reference and of the single-rank run (bit for bit where no tensor
// parallelism changes a summation order), and identical greedy tokens. The ranks are real processes (rank 0 + `batchgen
// rank` children) joined by the rendezvous, talking through the shared-memory comms and expert exchange.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "formats/safetensors.h"
#include "golden/golden_runner.h"
#include "process_testing.h"
#include "temp_dir.h"

namespace bg::testing {
namespace {

struct RankLayout {
  std::string name;
  std::vector<std::string> flags;
  bool bitwise;  // no TP: every row meets exactly the single-rank arithmetic
  bool in_ci;    // CI runs a representative few; BG_RANK_SWEEP=1 runs every layout (docs/PARALLEL.md, "Tests")
};

// Runs `argv` with one thread per rank process; stderr goes to `log`. Returns the exit status.
int run(const std::vector<std::string>& argv, const std::filesystem::path& log) {
  return run_process(argv, log, {{"BG_NUM_THREADS", "1"}});
}

// Logits of prefill(prompt) + teacher-forced decode of the rest, as `score` computes them, on one rank.
std::vector<float> single_rank(Model& model, const GoldenPrompt& g) {
  const int64_t V = model.info().vocab_size, L = static_cast<int64_t>(g.prompt.size());
  std::vector<float> out(g.tokens.size() * static_cast<size_t>(V));
  const int64_t n = static_cast<int64_t>(g.tokens.size());
  auto state = make_state(model, 1, n);
  auto seq = state->new_sequence(n);
  std::span<const int32_t> all(g.tokens);
  model.forward(*seq, all.subspan(0, static_cast<size_t>(L)), out.data());
  for (size_t t = static_cast<size_t>(L); t < g.tokens.size(); ++t) model.forward(*seq, all.subspan(t, 1), out.data() + t * V);
  return out;
}

class ParallelScore : public ::testing::TestWithParam<RankLayout> {};

TEST_P(ParallelScore, EveryGoldenCaseEqualsOneRank) {
  const RankLayout& layout = GetParam();
  const char* sweep = std::getenv("BG_RANK_SWEEP");
  if (!layout.in_ci && (sweep == nullptr || std::string(sweep) != "1")) {
    GTEST_SKIP() << layout.name << ": part of the full rank-layout sweep only (BG_RANK_SWEEP=1)";
  }
  TempDir tmp;
  const std::string exe = std::string(BG_BINARY_DIR) + "/batchgen";
  int cases = 0;
  for (const char* arch : {"deepseek_v3", "kimi_k3"}) {
    for (const auto& entry : std::filesystem::directory_iterator(golden_dir() / arch)) {
      if (!entry.is_directory()) continue;
      GoldenCase gc(entry.path());
      auto model = load_model(gc.model_dir());
      const int64_t V = model->info().vocab_size;
      for (int64_t i = 0; i < gc.n_prompts(); ++i) {
        const GoldenPrompt g = gc.prompt(i);
        const std::string what = entry.path().filename().string() + " prompt " + std::to_string(i);
        const std::filesystem::path out = tmp.path() / "logits.safetensors", log = tmp.path() / "score.log";
        std::vector<std::string> argv = {exe, "score", "--model", gc.model_dir().string(), "--tokens",
                                         join_ids(g.tokens), "--prefill", std::to_string(g.prompt.size()),
                                         "--out", out.string()};
        argv.insert(argv.end(), layout.flags.begin(), layout.flags.end());
        ASSERT_EQ(run(argv, log), 0) << what << "\n" << read_file(log);
        auto file = SafetensorsFile::open(out);
        const std::vector<float> got = file->view("logits").to_f32();
        const std::vector<float> one = single_rank(*model, g);
        ASSERT_EQ(got.size(), one.size()) << what;
        const int64_t T = static_cast<int64_t>(g.tokens.size()), L = static_cast<int64_t>(g.prompt.size());
        for (int64_t t = 0; t < T; ++t) {
          const float* row = got.data() + t * V;
          EXPECT_LE(row_rel_error(row, g.logits.data() + t * V, V), kLogitTolerance) << what << " row " << t;
          if (layout.bitwise) {
            ASSERT_EQ(std::memcmp(row, one.data() + t * V, static_cast<size_t>(V) * 4), 0) << what << " row " << t;
          } else {
            EXPECT_LE(row_rel_error(row, one.data() + t * V, V), kLogitTolerance) << what << " row " << t;
          }
          if (t + 1 < T && t + 1 >= L) {
            EXPECT_EQ(argmax_row(row, V), g.tokens[static_cast<size_t>(t + 1)]) << what << " greedy at " << t + 1;
          }
        }
        ++cases;
      }
    }
  }
  EXPECT_GT(cases, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ParallelScore,
    ::testing::Values(RankLayout{"ep2", {"--ep", "2"}, true, true},
                      RankLayout{"ep4", {"--ep", "4", "--k3-moe-exchange", "ll"}, true, false},
                      RankLayout{"ep8", {"--ep-size", "8"}, true, false},
                      RankLayout{"tp2", {"--tp", "2"}, false, true},
                      RankLayout{"dp2_ep4", {"--dp", "2", "--ep", "4"}, false, false},
                      RankLayout{"dp2_tp2_ep4", {"--dp", "2", "--tp", "2", "--ep", "4", "--moe-exchange-tokens", "16"},
                                 false, true}),
    [](const auto& param_info) { return param_info.param.name; });

// Two "nodes" on this host (the same `score` command with --nnodes 2 and --node-rank 0 / 1, joined over TCP at
// --dist-init-addr, two ranks each): node 0 writes one rank's logits bit for bit, node 1 writes nothing and exits 0.
TEST(ParallelScoreNodes, TwoNodesOnOneHostEqualOneRank) {
  TempDir tmp;
  const std::string exe = std::string(BG_BINARY_DIR) + "/batchgen";
  GoldenCase gc(golden_dir() / "kimi_k3" / "k3-tiny");
  auto model = load_model(gc.model_dir());
  const int64_t V = model->info().vocab_size;
  const GoldenPrompt g = gc.prompt(0);
  const int port = free_tcp_port();
  ASSERT_GT(port, 0);
  // With a node secret: the rendezvous over TCP is a CURVE server and every rank a client holding the key.
  const std::string secret = write_secret_file(tmp, "node.secret", std::string(32, 'n'));
  auto argv_of = [&](int node, const std::filesystem::path& out) {
    return std::vector<std::string>{exe, "score", "--model", gc.model_dir().string(), "--tokens", join_ids(g.tokens),
                                    "--prefill", std::to_string(g.prompt.size()), "--out", out.string(), "--ep", "4",
                                    "--nnodes", "2", "--node-rank", std::to_string(node), "--dist-init-addr",
                                    "127.0.0.1:" + std::to_string(port), "--node-secret-file", secret};
  };
  const std::filesystem::path out0 = tmp.path() / "node0.safetensors", out1 = tmp.path() / "node1.safetensors";
  int node1_status = -1;
  std::thread node1([&] { node1_status = run(argv_of(1, out1), tmp.path() / "node1.log"); });
  const int node0_status = run(argv_of(0, out0), tmp.path() / "node0.log");
  node1.join();
  ASSERT_EQ(node0_status, 0) << read_file(tmp.path() / "node0.log");
  ASSERT_EQ(node1_status, 0) << read_file(tmp.path() / "node1.log");
  EXPECT_FALSE(std::filesystem::exists(out1)) << "node 1 wrote a result";
  EXPECT_NE(read_file(tmp.path() / "node0.log").find("ranks 2..3 join from the other nodes"), std::string::npos);
  auto file = SafetensorsFile::open(out0);
  const std::vector<float> got = file->view("logits").to_f32();
  const std::vector<float> one = single_rank(*model, g);
  ASSERT_EQ(got.size(), one.size());
  EXPECT_EQ(std::memcmp(got.data(), one.data(), got.size() * 4), 0) << "logits differ from one rank";
  EXPECT_EQ(static_cast<int64_t>(got.size()), static_cast<int64_t>(g.tokens.size()) * V);
}

// Node 0 without node 1, or with a node 1 holding another --node-secret-file: a clear error naming the ranks that never
// joined (and their node) once the rank timeout passes, never a hang; a malformed --dist-init-addr, or ll-fp8 on CPU
// ranks, is refused before anything starts.
TEST(ParallelScoreNodes, AMissingNodeIsNamedAfterTheRankTimeout) {
  TempDir tmp;
  const std::string exe = std::string(BG_BINARY_DIR) + "/batchgen";
  GoldenCase gc(golden_dir() / "kimi_k3" / "k3-tiny");
  const int port = free_tcp_port();
  ASSERT_GT(port, 0);
  std::vector<std::string> argv = {exe, "score", "--model", gc.model_dir().string(), "--tokens", "1,2,3", "--out",
                                   (tmp.path() / "x.safetensors").string(), "--ep", "4", "--nnodes", "2",
                                   "--node-rank", "0", "--dist-init-addr", "127.0.0.1:" + std::to_string(port)};
  setenv("BG_RANK_TIMEOUT_S", "3", 1);
  const auto t0 = std::chrono::steady_clock::now();
  const int status = run(argv, tmp.path() / "node0.log");
  unsetenv("BG_RANK_TIMEOUT_S");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string log = read_file(tmp.path() / "node0.log");
  EXPECT_EQ(status, 1) << log;
  EXPECT_LT(s, 30.0);
  EXPECT_NE(log.find("ranks that never joined: 2 (node 1), 3 (node 1)"), std::string::npos) << log;
  // Node 1 there but holding another secret than node 0: its ranks are never let in, and both nodes say so.
  std::vector<std::string> keyed = argv;
  keyed.insert(keyed.end(), {"--node-secret-file", write_secret_file(tmp, "a.secret", std::string(32, 'a'))});
  std::vector<std::string> intruder = keyed;
  intruder[std::find(intruder.begin(), intruder.end(), "--node-rank") - intruder.begin() + 1] = "1";
  intruder.back() = write_secret_file(tmp, "b.secret", std::string(32, 'b'));
  setenv("BG_RANK_TIMEOUT_S", "3", 1);
  int intruder_status = -1;
  std::thread node1([&] { intruder_status = run(intruder, tmp.path() / "intruder.log"); });
  const int keyed_status = run(keyed, tmp.path() / "keyed.log");
  node1.join();
  unsetenv("BG_RANK_TIMEOUT_S");
  EXPECT_EQ(keyed_status, 1);
  EXPECT_NE(read_file(tmp.path() / "keyed.log").find("ranks that never joined: 2 (node 1), 3 (node 1)"),
            std::string::npos) << read_file(tmp.path() / "keyed.log");
  EXPECT_EQ(intruder_status, 1);
  EXPECT_NE(read_file(tmp.path() / "intruder.log").find("does every node hold the same --node-secret-file?"),
            std::string::npos) << read_file(tmp.path() / "intruder.log");
  argv.back() = "127.0.0.1";
  EXPECT_EQ(run(argv, tmp.path() / "bad.log"), 1);
  EXPECT_NE(read_file(tmp.path() / "bad.log").find("must be host:port"), std::string::npos);
  // CPU ranks have no FP8 exchange: ll-fp8 is refused before any rank starts, not run exactly without the rounding.
  const std::vector<std::string> fp8 = {exe, "score", "--model", gc.model_dir().string(), "--tokens", "1,2,3", "--out",
                                        (tmp.path() / "y.safetensors").string(), "--ep", "2", "--k3-moe-exchange",
                                        "ll-fp8"};
  EXPECT_EQ(run(fp8, tmp.path() / "fp8.log"), 1);
  EXPECT_NE(read_file(tmp.path() / "fp8.log").find("ll-fp8 quantizes the dispatched rows of CUDA ranks"),
            std::string::npos) << read_file(tmp.path() / "fp8.log");
}

}  // namespace
}  // namespace bg::testing
