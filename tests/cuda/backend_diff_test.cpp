// Layer-by-layer diff of the CUDA backend against the CPU backend on the same checkpoint and tokens (prefill, then
// decode steps), with the GPU forced onto the CPU's expert choices (near-tied routers of the tiny models would
// otherwise flip): a diagnostic that names the first layer where the GPU leaves the bf16 envelope.
#include <gtest/gtest.h>

#include <map>

#include "cuda/cuda_testing.h"
#include "golden/golden_util.h"
#include "model/model.h"

namespace bg::testing {
namespace {

using Taps = std::map<std::string, std::vector<float>>;

Taps run(Model& model, Sequence& seq, std::span<const int32_t> tokens, std::vector<float>& logits) {
  Taps taps;
  TapFn tap = [&](std::string_view name, int64_t layer, const float* data, int64_t n, int64_t dim) {
    taps[std::string(name) + "." + std::to_string(layer)].assign(data, data + n * dim);
  };
  logits.resize(tokens.size() * static_cast<size_t>(model.info().vocab_size));
  model.forward(seq, tokens, logits.data(), &tap);
  return taps;
}

void diff_case(const std::string& arch, const std::string& name, int64_t prefill, int64_t decode_steps) {
  const double bound = bf16_logit_bound(arch);
  GoldenCase gc(golden_dir() / arch / name);
  GoldenPrompt g = gc.prompt(gc.n_prompts() - 1);
  auto cpu = load_model(gc.model_dir(), LoadOptions{.device = "cpu"});
  auto gpu = load_model(gc.model_dir(), LoadOptions{.device = "cuda"});
  auto cpu_state = make_state(*cpu, 1, 1024), gpu_state = make_state(*gpu, 1, 1024);
  auto sc = cpu_state->new_sequence(1024);
  auto sg = gpu_state->new_sequence(1024);
  RoutingTape routing;  // the CPU's, per MoE layer of a step
  cpu->set_route_hook(routing.recorder());
  std::span<const int32_t> all(g.tokens);
  double worst = 0.0;
  for (int64_t step = 0; step <= decode_steps; ++step) {
    auto piece = step == 0 ? all.subspan(0, static_cast<size_t>(prefill))
                           : all.subspan(static_cast<size_t>(prefill + step - 1), 1);
    std::vector<float> lc, lg;
    routing.clear();
    Taps tc = run(*cpu, *sc, piece, lc);
    gpu->set_route_hook(routing.replayer());
    Taps tg = run(*gpu, *sg, piece, lg);
    std::string first_bad;
    for (const auto& [key, ref] : tc) {
      double e = max_rel_error(tg[key], ref);
      if (e > bound && first_bad.empty()) first_bad = key;
    }
    double le = max_rel_error(lg, lc);
    worst = std::max(worst, le);
    std::printf("[diff] %s %s step %ld (%zu tokens): logits %.3e, first tap above %.0e: %s\n", arch.c_str(),
                name.c_str(), static_cast<long>(step), piece.size(), le, bound, first_bad.empty() ? "-" : first_bad.c_str());
    if (!first_bad.empty()) {
      for (const auto& [key, ref] : tc) std::printf("    %-16s %.3e\n", key.c_str(), max_rel_error(tg[key], ref));
      // Per-token errors of the first layer tap above the threshold: one or two bad tokens point at routing flips,
      // every token bad at a computation bug.
      for (const auto& [key, ref] : tc) {
        if (key.rfind("layer.", 0) != 0 || max_rel_error(tg[key], ref) <= bound) continue;
        const size_t n = piece.size(), d = ref.size() / n;
        std::printf("    per-token %s:", key.c_str());
        for (size_t t = 0; t < n; ++t) {
          std::vector<float> a(tg[key].begin() + t * d, tg[key].begin() + (t + 1) * d);
          std::vector<float> b(ref.begin() + t * d, ref.begin() + (t + 1) * d);
          std::printf(" %.2e", max_rel_error(a, b));
        }
        std::printf("\n");
        break;
      }
    }
  }
  EXPECT_LE(worst, bound) << arch << "/" << name;
}

TEST(BackendDiff, DeepseekPrefillThenDecode) {
  BG_REQUIRE_GPU();
  diff_case("deepseek_v3", "tiny-fp32", 7, 3);
}

TEST(BackendDiff, KimiK3PrefillThenDecode) {
  BG_REQUIRE_GPU();
  diff_case("kimi_k3", "k3-tiny", 7, 3);
}

// Decode only (a one-token prompt): the layer errors of single-token steps.
TEST(BackendDiff, KimiK3DecodeOnly) {
  BG_REQUIRE_GPU();
  diff_case("kimi_k3", "k3-tiny", 1, 8);
}

// A long prefill (four KDA chunks) of the long K3 case.
TEST(BackendDiff, KimiK3LongPrefill) {
  BG_REQUIRE_GPU();
  diff_case("kimi_k3", "k3-tiny-long", 250, 2);
}

TEST(BackendDiff, DeepseekDecodeOnly) {
  BG_REQUIRE_GPU();
  diff_case("deepseek_v3", "tiny-mxfp4", 1, 8);
}

}  // namespace
}  // namespace bg::testing
