// `batchgen score --device cuda` with 2 and 4 rank processes sharing this GPU through the ll exchange (CUDA IPC
// between the processes), against one rank on the same GPU, on every golden case and prompt: the logits must be equal
// bit for bit. Both runs pin the same expert kernels (BG_MOE_W4A16=0 keeps the experts for the stage kernels,
// BG_MOE_FFN_PATH=tiled and a grouped threshold out of reach make a row's arithmetic independent of how many rows its
// expert got; BG_LINEAR_GROUPS=0 because one rank fuses K3's latent-down with the shared experts' gate and up into one
// GEMM where a rank set runs them apart), so what differs between them is the exchange alone: every pair's row must
// reach its expert on the right rank and come back, and the combine must add the k outputs in the loopback's order.
// The CLI is $BG_BATCHGEN when set (the GPU machine's bundle), else the build's batchgen.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda/cuda_testing.h"
#include "formats/safetensors.h"
#include "golden/golden_util.h"
#include "process_testing.h"
#include "temp_dir.h"

namespace bg::testing {
namespace {

std::string batchgen_path() {
  const char* env = std::getenv("BG_BATCHGEN");
  return env != nullptr && env[0] != '\0' ? std::string(env) : std::string(BG_BINARY_DIR) + "/batchgen";
}

// The CLI the tests run, or a failure saying where it was looked for (a bundle on another machine sets BG_BATCHGEN).
#define BG_REQUIRE_CLI()                                                                                          \
  ASSERT_EQ(access(batchgen_path().c_str(), X_OK), 0) << "no executable batchgen at " << batchgen_path()        \
                                                      << " (set BG_BATCHGEN to the CLI)"

// Runs argv with the pinned-kernel environment (plus `env`); stderr to `log`. Returns the exit status.
int run(const std::vector<std::string>& argv, const std::filesystem::path& log,
        const std::vector<std::pair<std::string, std::string>>& env = {}) {
  std::vector<std::pair<std::string, std::string>> all = {
      {"BG_MOE_W4A16", "0"}, {"BG_MOE_FFN_PATH", "tiled"}, {"BG_MOE_GROUPED_MIN_ROWS", "1000000000"},
      {"BG_LINEAR_GROUPS", "0"}};
  all.insert(all.end(), env.begin(), env.end());
  return run_process(argv, log, all);
}

std::vector<float> score(const GoldenCase& gc, const GoldenPrompt& g, const std::vector<std::string>& flags,
                         const std::filesystem::path& dir, const std::string& what) {
  const std::filesystem::path out = dir / "logits.safetensors", log = dir / "score.log";
  std::filesystem::remove(out);
  std::vector<std::string> argv = {batchgen_path(), "score", "--device", "cuda", "--model", gc.model_dir().string(),
                                   "--tokens", join_ids(g.tokens), "--prefill", std::to_string(g.prompt.size()),
                                   "--out", out.string()};
  argv.insert(argv.end(), flags.begin(), flags.end());
  const int rc = run(argv, log);
  EXPECT_EQ(rc, 0) << what << "\n" << read_file(log);
  if (rc != 0) return {};
  // A run that succeeded logs no error: the ranks leaving at the end of the job is not a failure.
  const std::string text = read_file(log);
  EXPECT_EQ(text.find("[error]"), std::string::npos) << what << ": an error logged by a successful run\n" << text;
  return SafetensorsFile::open(out)->view("logits").to_f32();
}

class LlScoreGpu : public ::testing::TestWithParam<int> {};

TEST_P(LlScoreGpu, EveryGoldenCaseEqualsOneRankBitForBit) {
  BG_REQUIRE_GPU();
  BG_REQUIRE_CLI();
  const int ranks = GetParam();
  TempDir tmp;
  int cases = 0;
  for (const char* arch : {"deepseek_v3", "kimi_k3"}) {
    for (const auto& entry : std::filesystem::directory_iterator(golden_dir() / arch)) {
      if (!entry.is_directory()) continue;
      GoldenCase gc(entry.path());
      for (int64_t i = 0; i < gc.n_prompts(); ++i) {
        const GoldenPrompt g = gc.prompt(i);
        const std::string what = entry.path().filename().string() + " prompt " + std::to_string(i);
        const std::vector<float> one = score(gc, g, {}, tmp.path(), what + " (one rank)");
        const std::vector<float> got = score(gc, g, {"--ep", std::to_string(ranks), "--k3-moe-exchange", "ll"},
                                             tmp.path(), what + " (" + std::to_string(ranks) + " ranks, ll)");
        ASSERT_FALSE(one.empty()) << what;
        ASSERT_EQ(got.size(), one.size()) << what;
        for (size_t j = 0; j < got.size(); ++j) {
          ASSERT_TRUE(std::isfinite(got[j])) << what << " value " << j;
          ASSERT_EQ(std::memcmp(&got[j], &one[j], 4), 0) << what << " value " << j << ": " << got[j] << " vs "
                                                         << one[j];
        }
        ++cases;
      }
    }
  }
  EXPECT_GT(cases, 0);
}

// A rank that fails mid-run stops the whole set within seconds. The test's device-fault injection makes the first
// step that begins while the file exists throw a device fault, in whichever rank gets there first. When that is rank
// 1, rank 0 is left waiting in an exchange kernel: its watchdog sees the set marked failed and the kernel traps, long
// before the rank timeout (120 s here, so a wait that runs it out fails the time bound).
TEST(LlScoreGpuFailure, ARankThatFailsStopsTheSetWithinSeconds) {
  BG_REQUIRE_GPU();
  BG_REQUIRE_CLI();
  TempDir tmp;
  const std::filesystem::path fault = tmp.path() / "fault";
  std::ofstream(fault) << "armed\n";
  GoldenCase gc(golden_dir() / "kimi_k3" / "k3-tiny");
  const GoldenPrompt g = gc.prompt(0);
  const std::filesystem::path out = tmp.path() / "logits.safetensors", log = tmp.path() / "score.log";
  const std::vector<std::string> argv = {batchgen_path(), "score", "--device", "cuda", "--model",
                                         gc.model_dir().string(), "--tokens", join_ids(g.tokens), "--out",
                                         out.string(), "--ep", "2", "--k3-moe-exchange", "ll"};
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = run(argv, log, {{"BG_TEST_DEVICE_FAULT_FILE", fault.string()}, {"BG_RANK_TIMEOUT_S", "120"}});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(rc, 0) << read_file(log);
  EXPECT_FALSE(std::filesystem::exists(fault)) << "the injected fault was not consumed";
  EXPECT_LT(s, 60.0) << "the set took " << s << " s to stop\n" << read_file(log);
  std::printf("[ll failure] exit %d after %.1f s\n", rc, s);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlScoreGpu, ::testing::Values(2, 4),
                         [](const auto& param_info) { return "ep" + std::to_string(param_info.param); });

}  // namespace
}  // namespace bg::testing
