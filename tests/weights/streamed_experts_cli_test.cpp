// `--resident-experts` / `--expert-trace` / `--write-expert-trace` through `batchgen score`: streamed experts give the
// all-resident logits bit for bit (one rank, an expert-parallel rank set, through the weight store), a trace written
// by one run steers the next, and bad values are clear errors.
#include <gtest/gtest.h>

#include <fstream>
#include <numeric>

#include "golden/golden_util.h"
#include "moe/expert_stream.h"
#include "weights_testing.h"

namespace bg::testing {
namespace {

TEST(StreamedExpertsCli, ScoreEqualsTheResidentModelAndTracesRoundTrip) {
  const std::filesystem::path model = golden_dir() / "kimi_k3" / "k3-tiny" / "model";
  const std::vector<float> resident = score_logits(model, {});
  ASSERT_FALSE(resident.empty());
  TempDir tmp;
  const std::filesystem::path trace = tmp / "trace.json";
  EXPECT_EQ(score_logits(model, {"--resident-experts", "0", "--write-expert-trace", trace.string()}), resident);
  const auto counts = moe::read_expert_trace(trace, 16);
  ASSERT_FALSE(counts.empty());
  uint64_t pairs = 0;
  for (const auto& [layer, c] : counts) pairs += std::accumulate(c.begin(), c.end(), uint64_t{0});
  EXPECT_EQ(pairs % 4, 0u) << "top-4: every token is routed to 4 experts in each MoE layer";
  EXPECT_GT(pairs, 0u);
  EXPECT_EQ(score_logits(model, {"--resident-experts", "0.5", "--expert-trace", trace.string()}), resident);
  EXPECT_EQ(score_logits(model, {"--resident-experts", "0.25", "--ep", "2"}), resident)
      << "an expert-parallel rank set streams on every rank and equals one rank bit for bit";
}

TEST(StreamedExpertsCli, BadValuesAreClearErrors) {
  const std::filesystem::path model = golden_dir() / "kimi_k3" / "k3-tiny" / "model";
  TempDir tmp;
  const std::string out = (tmp / "logits.safetensors").string();
  auto score = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"score", "--model", model.string(), "--tokens", "1,2,3", "--out", out};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_batchgen(args);
  };
  CmdResult r = score({"--resident-experts", "1.5"});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--resident-experts"), std::string::npos) << r.err;
  r = score({"--write-expert-trace", (tmp / "t.json").string()});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("needs --resident-experts below 1"), std::string::npos) << r.err;
  const std::filesystem::path bad = tmp / "bad.json";
  std::ofstream(bad) << R"({"format": "batchgen-expert-trace", "version": 1, "n_experts": 8, "layers": []})";
  r = score({"--resident-experts", "0.5", "--expert-trace", bad.string()});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("a trace of 8 experts for a model with 16"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace bg::testing
