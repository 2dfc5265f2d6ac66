// `batchgen score` with several CPU rank processes (--ep / --tp / --dp layouts) against one rank, on every golden case
// and prompt: each logit row within 1e-4 of the reference and of the single-rank run (bit for bit where no tensor
// parallelism changes a summation order), and identical greedy tokens. The ranks are real processes (rank 0 + `batchgen
// rank` children) joined by the rendezvous, talking through the shared-memory comms and expert exchange.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "formats/safetensors.h"
#include "golden/golden_runner.h"
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
  std::vector<char*> c;
  for (const std::string& a : argv) c.push_back(const_cast<char*>(a.c_str()));
  c.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("BG_NUM_THREADS", "1", 1);
    FILE* f = std::freopen(log.c_str(), "w", stderr);
    (void)f;
    execv(c[0], c.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) s.push_back(',');
    s.append(std::to_string(ids[i]));
  }
  return s;
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
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

}  // namespace
}  // namespace bg::testing
