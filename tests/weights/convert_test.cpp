// batchgen convert: OCP MXFP4 rounding, a layout-only re-pack computing exactly the original, BF16/F32/FP8 experts ->
// MXFP4 with a stated error, and the refusals; load progress rendering.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "formats/checkpoint.h"
#include "formats/quant.h"
#include "golden/golden_runner.h"
#include "model/model_testing.h"
#include "weights/checksum.h"
#include "weights/convert.h"
#include "weights/progress.h"
#include "weights/store_source.h"
#include "weights_testing.h"

namespace bg::testing {
namespace {

using namespace bg::weights;

TEST(Mxfp4Ocp, SharedScaleAndRoundToNearestEven) {
  std::vector<float> x(32, 0.0f);
  // amax 6 -> X = 2^(2 - 2) = 1: elements map to themselves.
  x[0] = 6.0f;
  x[1] = 0.25f;   // tie 0 / 0.5 -> 0 (even)
  x[2] = 0.75f;   // tie 0.5 / 1 -> 1 (even code 2)
  x[3] = 2.5f;    // tie 2 / 3 -> 2
  x[4] = 5.0f;    // tie 4 / 6 -> 4
  x[5] = -1.25f;  // tie 1 / 1.5 -> -1
  x[6] = 1.3f;    // nearest 1.5
  uint8_t codes[16], scale[1];
  quantize_row_mxfp4_ocp(x.data(), 32, codes, scale, "t");
  EXPECT_EQ(scale[0], 127);
  auto code = [&](int i) { return (codes[i / 2] >> (4 * (i % 2))) & 0xf; };
  EXPECT_EQ(code(0), 7);
  EXPECT_EQ(code(1), 0);
  EXPECT_EQ(code(2), 2);
  EXPECT_EQ(code(3), 4);
  EXPECT_EQ(code(4), 6);
  EXPECT_EQ(code(5), 0x8 | 2);
  EXPECT_EQ(code(6), 3);
  // Just below 8: floor(log2) is 2 (X = 1), and the value saturates to 6; a float log2 would round to 3.
  x.assign(32, 0.0f);
  x[0] = std::nextafter(8.0f, 0.0f);
  quantize_row_mxfp4_ocp(x.data(), 32, codes, scale, "t");
  EXPECT_EQ(scale[0], 127);
  EXPECT_EQ(code(0), 7);
  x[0] = 8.0f;  // X = 2: 8 -> 4
  quantize_row_mxfp4_ocp(x.data(), 32, codes, scale, "t");
  EXPECT_EQ(scale[0], 128);
  EXPECT_EQ(code(0), 6);
  x.assign(32, 0.0f);  // all zero: the smallest scale, zero codes
  quantize_row_mxfp4_ocp(x.data(), 32, codes, scale, "t");
  EXPECT_EQ(scale[0], 0);
  EXPECT_EQ(codes[0], 0);
  x[9] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(bg_error_of([&] { quantize_row_mxfp4_ocp(x.data(), 32, codes, scale, "w"); }).find("not finite"),
            std::string::npos);
}

// OCP MXFP4 of one 32-group, written from the spec independently of the converter: X = 2^(floor(log2 amax) - 2) with
// the exponent taken from frexp, each element the E2M1 value nearest v / X on its own sign, ties to the even code.
void ocp_reference(const float* v, uint8_t* codes, uint8_t* scale) {
  static const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
  int ex = 0;
  std::frexp(amax, &ex);  // amax = m * 2^ex, m in [0.5, 1): floor(log2 amax) = ex - 1
  const int e = amax == 0.0f ? -127 : std::clamp(ex - 1 - 2, -127, 127);
  *scale = static_cast<uint8_t>(e + 127);
  for (int j = 0; j < 32; ++j) {
    const double t = std::fabs(static_cast<double>(v[j])) / std::ldexp(1.0, e);
    int best = 0;
    for (int c = 1; c < 8; ++c) {
      const double d = std::fabs(kMag[c] - t), bd = std::fabs(kMag[best] - t);
      if (d < bd || (d == bd && c % 2 == 0)) best = c;
    }
    const int code = (std::signbit(v[j]) ? 8 : 0) | best;
    if (j % 2 == 0) codes[j / 2] = static_cast<uint8_t>(code);
    else codes[j / 2] = static_cast<uint8_t>(codes[j / 2] | (code << 4));
  }
}

std::vector<float> logits_of(const std::filesystem::path& model, const std::vector<int32_t>& prompt) {
  auto m = load_model(model);
  return run_prefill_then_decode(*m, prompt, 6).logits;
}

TEST(Convert, StoreLayoutRepackComputesExactlyTheOriginal) {
  TempDir tmp;
  const auto model = golden_model("kimi_k3/k3-tiny");
  ConvertOptions o;
  o.in = model;
  o.out = tmp / "store";
  o.store_layout = true;
  o.segment_max_bytes = 512 << 10;
  o.progress_tty = 0;
  const ConvertReport r = convert_checkpoint(o);
  EXPECT_EQ(r.n_quantized, 0);
  EXPECT_EQ(r.bytes_in, r.bytes_out);
  ASSERT_TRUE(is_store_dir(o.out));
  EXPECT_TRUE(std::filesystem::exists(o.out / "config.json"));
  EXPECT_TRUE(std::filesystem::exists(o.out / "convert.json"));
  EXPECT_FALSE(std::filesystem::exists(o.out / "model-00001-of-00002.safetensors"));
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  EXPECT_EQ(logits_of(o.out, prompt), logits_of(model, prompt)) << "a layout-only re-pack is exact";
  // weightd loads it without re-layout, and an engine through the store computes the same.
  StoreGuard g;
  InProcessDaemon d(daemon_options(o.out, g.name()));
  ASSERT_EQ(d.wait_ready(), "");
  auto stored = load_model(o.out, load_options(g.name()));
  EXPECT_EQ(run_prefill_then_decode(*stored, prompt, 6).logits, logits_of(model, prompt));
  // And back to safetensors, byte for byte.
  ConvertOptions back;
  back.in = o.out;
  back.out = tmp / "back";
  back.progress_tty = 0;
  convert_checkpoint(back);
  auto a = Checkpoint::open(model), b = Checkpoint::open(back.out);
  ASSERT_EQ(a->names(), b->names());
  for (const auto& n : a->names()) {
    EXPECT_EQ(std::memcmp(a->get(n).data, b->get(n).data, a->get(n).nbytes), 0) << n;
    EXPECT_EQ(a->file_of(n), b->file_of(n)) << n;
  }
}

// BF16 / F32 / FP8 experts -> MXFP4: the converted checkpoint loads, only the expert linears changed, and its error
// against the float64 reference is stated (printed) and bounded.
TEST(Convert, ExpertsToMxfp4HaveAStatedError) {
  for (const std::string c : {"deepseek_v3/tiny-fp32", "deepseek_v3/tiny-fp8"}) {
    TempDir tmp;
    GoldenCase gc(golden_dir() / c);
    for (bool store : {false, true}) {
      ConvertOptions o;
      o.in = gc.model_dir();
      o.out = tmp / (store ? "store" : "st");
      o.experts_mxfp4 = true;
      o.store_layout = store;
      o.progress_tty = 0;
      const ConvertReport r = convert_checkpoint(o);
      EXPECT_EQ(r.n_quantized, 3 * 16 * 3) << c;  // gate/up/down x 16 experts x 3 MoE layers
      EXPECT_GT(r.max_rel_rms_error, 0.05) << c;
      EXPECT_LT(r.max_rel_rms_error, 0.2) << c;
      auto conv = load_model(o.out);
      double worst = 0.0;
      for (int64_t i = 0; i < gc.n_prompts(); ++i) {
        const GoldenPrompt p = gc.prompt(i);
        const EngineRun run = run_prefill_then_decode(*conv, p.prompt, 0);
        const int64_t V = conv->info().vocab_size;
        for (size_t t = 0; t < p.prompt.size(); ++t) {
          worst = std::max(worst, row_rel_error(run.logits.data() + t * V, p.logits.data() + t * V, V));
        }
      }
      std::printf("%s experts -> MXFP4 (%s): weight rel RMS error max %.4f mean %.4f; logits vs reference max rel "
                  "err %.4f\n", c.c_str(), store ? "store layout" : "safetensors", r.max_rel_rms_error,
                  r.mean_rel_rms_error, worst);
      // Random tiny models amplify weight noise (a 12% weight error moves their small logits a lot); the bound
      // catches a broken conversion (wrong scale, nibble order: errors of order 1 or NaN), the value is stated.
      EXPECT_GT(worst, 1e-4) << "the quantization must show";
      EXPECT_LT(worst, 0.6) << c;
    }
    // One converted expert matrix equals the spec's MXFP4 of the original values, byte for byte.
    auto orig_ckpt = Checkpoint::open(gc.model_dir());
    auto conv_ckpt = Checkpoint::open(tmp / "st");
    const std::string prefix = "model.layers.2.mlp.experts.5.down_proj";
    const TensorView w = orig_ckpt->get(prefix + ".weight");
    const QuantWeight q = load_linear(*orig_ckpt, prefix, w.shape[0], w.shape[1]);
    const TensorView packed = conv_ckpt->get(prefix + ".weight_packed"), scales = conv_ckpt->get(prefix + ".weight_scale");
    std::vector<float> row(static_cast<size_t>(q.n_in));
    std::vector<uint8_t> want_codes(16), want_scale(1);
    for (int64_t r = 0; r < q.n_out; ++r) {
      q.decode_row(r, row.data());
      for (int64_t g = 0; g < q.n_in / 32; ++g) {
        ocp_reference(row.data() + g * 32, want_codes.data(), want_scale.data());
        const auto* got_codes = reinterpret_cast<const uint8_t*>(packed.data) + r * (q.n_in / 2) + g * 16;
        const auto* got_scale = reinterpret_cast<const uint8_t*>(scales.data) + r * (q.n_in / 32) + g;
        ASSERT_EQ(*got_scale, want_scale[0]) << c << " row " << r << " group " << g;
        ASSERT_EQ(std::memcmp(got_codes, want_codes.data(), 16), 0) << c << " row " << r << " group " << g;
      }
    }
    auto st = Checkpoint::open(tmp / "st");
    auto orig = Checkpoint::open(gc.model_dir());
    EXPECT_EQ(st->get("model.layers.1.mlp.experts.0.gate_proj.weight_packed").dtype, DType::kU8);
    EXPECT_FALSE(st->contains("model.layers.1.mlp.experts.0.gate_proj.weight"));
    const auto emb = orig->get("model.embed_tokens.weight");
    EXPECT_EQ(std::memcmp(st->get("model.embed_tokens.weight").data, emb.data, emb.nbytes), 0);
    EXPECT_EQ(logits_of(tmp / "st", {1, 2, 3}), logits_of(tmp / "store", {1, 2, 3}));
  }
}

TEST(Convert, RefusesANonEmptyOutputAndTheInputItself) {
  TempDir tmp;
  const auto model = golden_model("deepseek_v3/tiny-fp8");
  std::ofstream(tmp / "x") << "x";
  ConvertOptions o;
  o.in = model;
  o.out = tmp.path();
  EXPECT_NE(bg_error_of([&] { convert_checkpoint(o); }).find("not empty"), std::string::npos);
  o.out = model;
  o.force = true;
  EXPECT_NE(bg_error_of([&] { convert_checkpoint(o); }).find("must differ"), std::string::npos);
  const CmdResult r = run_batchgen({"convert", "--model", model.string(), "--out", (tmp / "o").string(), "--experts",
                                    "mxfp4", "--layout", "store"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("quantized to MXFP4"), std::string::npos) << r.err;
  // Progress: the summary line of the conversion (bytes, seconds, rate).
  EXPECT_NE(r.err.find("converting " + model.string() + ": "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("GB/s)"), std::string::npos) << r.err;
  // Checksums: convert.json lists every output tensor's XXH64, and each matches the bytes written.
  const auto info = nlohmann::json::parse(read_file(tmp / "o" / "convert.json"));
  ASSERT_TRUE(info.contains("xxh64") && info["xxh64"].is_object()) << info.dump();
  auto out = StoreSource::open_dir(tmp / "o");
  ASSERT_EQ(info["xxh64"].size(), out->names().size());
  for (const std::string& n : out->names()) {
    const auto v = out->find(n);
    ASSERT_TRUE(v.has_value()) << n;
    EXPECT_EQ(info["xxh64"].value(n, std::string()),
              fmt::format("{:016x}", xxh64({v->data, v->nbytes})))
        << n;
  }
}

TEST(Progress, RendersBytesAndRatesPerFile) {
  EXPECT_EQ(format_bytes(999), "999 B");
  EXPECT_EQ(format_bytes(1'500'000), "1.5 MB");
  EXPECT_EQ(format_bytes(12'340'000'000), "12.34 GB");
  LoadProgress p("loading m", {{"a.safetensors", 2'000'000'000}, {"b.safetensors", 1'000'000'000}, {"c", 500'000'000}},
                 {.tty = 0});
  p.add(0, 1'000'000'000);
  p.add(2, 500'000'000);
  const auto lines = p.render_lines(2.0);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("1.50 GB / 3.50 GB (43%)"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("1 of 3 files done, 1 waiting"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("a.safetensors"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("1.00 GB / 2.00 GB"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("GB/s"), std::string::npos) << lines[1];
  const std::string log = p.log_line(2.0);
  EXPECT_NE(log.find("reading a.safetensors 50%"), std::string::npos) << log;
  EXPECT_NE(log.find("0.75 GB/s"), std::string::npos) << log;
}

}  // namespace
}  // namespace bg::testing
