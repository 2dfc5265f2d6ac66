// make-random: the same tensor names, dtypes, shapes and config fields as the published-layout golden checkpoints;
// every format loads and runs; bytes depend only on the seed; bad specs are clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "formats/checkpoint.h"
#include "formats/json_fields.h"
#include "model/model_testing.h"
#include "model/random_checkpoint.h"
#include "model/random_tensor_plan.h"

namespace bg::testing {
namespace {

using nlohmann::json;

RandomCheckpointSpec tiny_spec(const std::filesystem::path& out, const std::string& format, uint64_t seed = 7) {
  RandomCheckpointSpec s;
  s.arch = "deepseek_v3";
  s.preset = "tiny";
  s.format = format;
  s.seed = seed;
  s.out_dir = out;
  return s;
}

// Every regular file of a directory: name -> bytes.
std::map<std::string, std::string> dir_files(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out[e.path().filename().string()] = file_bytes(e.path());
  }
  return out;
}

class MakeRandomFormat : public ::testing::TestWithParam<std::string> {};

TEST_P(MakeRandomFormat, LoadsAndGivesFiniteDistinctLogits) {
  TempDir tmp;
  write_random_checkpoint(tiny_spec(tmp / "m", GetParam()));
  auto model = load_model(tmp / "m");
  const int64_t V = model->info().vocab_size;
  ASSERT_EQ(V, 512);
  EngineRun run = run_prefill_then_decode(*model, {3, 141, 59, 26, 5, 358, 97, 93, 238, 462, 64, 33}, 4);
  ASSERT_TRUE(all_finite(run.logits));
  // Not degenerate: each row has a clear spread, and the rows are not all the same distribution.
  std::set<int32_t> argmaxes;
  for (size_t t = 0; t < run.tokens.size(); ++t) {
    const float* row = run.logits.data() + t * static_cast<size_t>(V);
    auto [lo, hi] = std::minmax_element(row, row + V);
    EXPECT_GT(*hi - *lo, 4.0f) << "row " << t;
    argmaxes.insert(argmax_row(row, V));
  }
  EXPECT_GE(argmaxes.size(), 4u);
}

// The golden case holding the same layout as each format (bf16 has no golden: compared with fp32 names below).
std::string golden_case_of(const std::string& format) {
  if (format == "fp8") return "tiny-fp8";
  if (format == "mxfp4") return "tiny-mxfp4";
  return "tiny-fp32";
}

TEST_P(MakeRandomFormat, SameLayoutAsGoldenCheckpoint) {
  const std::string format = GetParam();
  TempDir tmp;
  write_random_checkpoint(tiny_spec(tmp / "m", format));
  const auto golden_model = golden_dir() / "deepseek_v3" / golden_case_of(format) / "model";
  auto ours = Checkpoint::open(tmp / "m");
  auto ref = Checkpoint::open(golden_model);
  auto our_names = ours->names(), ref_names = ref->names();
  std::sort(our_names.begin(), our_names.end());
  std::sort(ref_names.begin(), ref_names.end());
  ASSERT_EQ(our_names, ref_names);
  for (const auto& name : ref_names) {
    TensorView a = ours->get(name), b = ref->get(name);
    EXPECT_EQ(a.shape, b.shape) << name;
    DType want = b.dtype;
    if (format == "bf16" && want == DType::kF32 && name.find("e_score_correction_bias") == std::string::npos) {
      want = DType::kBF16;  // the fp32 golden stores everything F32; bf16 keeps only the router bias F32
    }
    EXPECT_EQ(dtype_name(a.dtype), dtype_name(want)) << name;
  }
  // config.json: every field of the golden config, with the same value (but the MTP count and dtype, see below).
  json cfg = read_json_file(tmp / "m" / "config.json"), gcfg = read_json_file(golden_model / "config.json");
  for (const auto& [key, value] : gcfg.items()) {
    ASSERT_TRUE(cfg.contains(key)) << key;
    if (key == "num_nextn_predict_layers" || key == "dtype") continue;  // no MTP layer written; dtype is filled in
    EXPECT_EQ(cfg[key], value) << key;
  }
  EXPECT_EQ(cfg["num_nextn_predict_layers"], 0);
  EXPECT_EQ(cfg.contains("quantization_config"), gcfg.contains("quantization_config"));
}

TEST_P(MakeRandomFormat, IndexListsEveryTensorOfItsShard) {
  TempDir tmp;
  write_random_checkpoint(tiny_spec(tmp / "m", GetParam()));
  json index = read_json_file(tmp / "m" / "model.safetensors.index.json");
  const json& map = index.at("weight_map");
  uint64_t total = 0;
  size_t n_tensors = 0;
  for (const char* file : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    auto shard = SafetensorsFile::open(tmp / "m" / file);
    ASSERT_FALSE(shard->header().entries.empty()) << file;
    EXPECT_EQ(shard->header().metadata.at("format"), "pt");
    for (const auto& e : shard->header().entries) {
      EXPECT_EQ(map.value(e.name, ""), file) << e.name;
      total += e.nbytes;
      ++n_tensors;
    }
  }
  EXPECT_EQ(map.size(), n_tensors);
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), total);
}

INSTANTIATE_TEST_SUITE_P(Formats, MakeRandomFormat, ::testing::Values("f32", "bf16", "fp8", "mxfp4"),
                         [](const auto& param_info) { return param_info.param; });

TEST(MakeRandom, SameSeedIsByteIdentical) {
  TempDir tmp;
  for (const char* format : {"f32", "bf16", "fp8", "mxfp4"}) {
    write_random_checkpoint(tiny_spec(tmp / (std::string("a_") + format), format, 11));
    write_random_checkpoint(tiny_spec(tmp / (std::string("b_") + format), format, 11));
    auto a = dir_files(tmp / (std::string("a_") + format)), b = dir_files(tmp / (std::string("b_") + format));
    ASSERT_EQ(a.size(), 4u);
    EXPECT_TRUE(a == b) << format;
  }
}

// The value generator: a million draws have the moments and tail masses of a standard normal (truncated at 4.33),
// any sub-range equals the same elements of a whole draw, and names decorrelate.
TEST(MakeRandom, ValuesAreNormalAndIndexedByElement) {
  std::vector<float> v(1 << 20);
  draw_random_normal(7, "w", 0, v, 0.0, 1.0);
  double sum = 0, sq = 0, beyond1 = 0, beyond2 = 0, peak = 0;
  for (float x : v) {
    sum += x;
    sq += double{x} * x;
    beyond1 += std::fabs(x) > 1.0f;
    beyond2 += std::fabs(x) > 2.0f;
    peak = std::max(peak, double{std::fabs(x)});
  }
  const double n = static_cast<double>(v.size());
  EXPECT_NEAR(sum / n, 0.0, 0.005);
  EXPECT_NEAR(std::sqrt(sq / n), 1.0, 0.005);
  EXPECT_NEAR(beyond1 / n, 0.3173, 0.003);
  EXPECT_NEAR(beyond2 / n, 0.0455, 0.001);
  EXPECT_LE(peak, 4.34);
  std::vector<float> piece(1000);
  draw_random_normal(7, "w", 12345, piece, 0.0, 1.0);
  EXPECT_TRUE(std::equal(piece.begin(), piece.end(), v.begin() + 12345));
  std::vector<float> scaled(1000), other(1000);
  draw_random_normal(7, "w", 12345, scaled, 2.0, 0.5);
  for (size_t i = 0; i < scaled.size(); ++i) EXPECT_FLOAT_EQ(scaled[i], 2.0f + 0.5f * piece[i]);
  draw_random_normal(7, "w2", 12345, other, 0.0, 1.0);
  EXPECT_NE(other, piece);
}

// The writer draws every element from (seed, name, index) and writes row pieces in place from many threads: neither
// the thread count nor the piece size (tiny pieces split every tensor into rows, FP8 into 128-row blocks) changes a
// byte, in any format, with any shard count.
TEST(MakeRandom, ThreadsAndPiecesDoNotChangeTheBytes) {
  TempDir tmp;
  for (const char* format : {"f32", "bf16", "fp8", "mxfp4"}) {
    const std::string f = format;
    RandomCheckpointSpec one = tiny_spec(tmp / ("one_" + f), f, 5);
    one.n_threads = 1;
    one.n_shards = 3;
    RandomCheckpointSpec many = tiny_spec(tmp / ("many_" + f), f, 5);
    many.n_threads = 3;
    many.n_shards = 3;
    many.piece_elements = 100;
    write_random_checkpoint(one);
    write_random_checkpoint(many);
    EXPECT_TRUE(dir_files(tmp / ("one_" + f)) == dir_files(tmp / ("many_" + f))) << format;
  }
}

TEST(MakeRandom, DifferentSeedsDiffer) {
  TempDir tmp;
  write_random_checkpoint(tiny_spec(tmp / "a", "bf16", 1));
  write_random_checkpoint(tiny_spec(tmp / "b", "bf16", 2));
  auto a = dir_files(tmp / "a"), b = dir_files(tmp / "b");
  EXPECT_EQ(a.at("config.json"), b.at("config.json"));
  EXPECT_EQ(a.at("model.safetensors.index.json"), b.at("model.safetensors.index.json"));
  EXPECT_NE(a.at("model-00001-of-00002.safetensors"), b.at("model-00001-of-00002.safetensors"));
  EXPECT_NE(a.at("model-00002-of-00002.safetensors"), b.at("model-00002-of-00002.safetensors"));
  auto ca = Checkpoint::open(tmp / "a"), cb = Checkpoint::open(tmp / "b");
  for (const auto& name : ca->names()) {
    EXPECT_NE(ca->get(name).to_f32(), cb->get(name).to_f32()) << name;
  }
}

TEST(MakeRandom, RefusesNonEmptyDirUnlessForced) {
  TempDir tmp;
  auto spec = tiny_spec(tmp / "m", "bf16", 1);
  write_random_checkpoint(spec);
  std::filesystem::remove(tmp / "m" / "model-00002-of-00002.safetensors");
  { std::ofstream(tmp / "m" / "notes.txt") << "keep me"; }
  EXPECT_NE(bg_error_of([&] { write_random_checkpoint(spec); }).find("is not empty"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(tmp / "m" / "model-00002-of-00002.safetensors"));  // nothing written
  spec.force = true;
  spec.n_shards = 3;
  write_random_checkpoint(spec);
  auto files = dir_files(tmp / "m");
  EXPECT_EQ(files.count("notes.txt"), 1u);
  EXPECT_EQ(files.count("model-00001-of-00002.safetensors"), 0u);  // the earlier run's shards are gone
  EXPECT_EQ(files.count("model-00003-of-00003.safetensors"), 1u);
  EXPECT_EQ(files.size(), 6u);  // config, index, 3 shards, notes
  EXPECT_NO_THROW(load_model(tmp / "m"));
}

TEST(MakeRandom, BadSpecsAreClearErrors) {
  TempDir tmp;
  auto err = [&](auto mutate) {
    auto s = tiny_spec(tmp / "m", "bf16");
    mutate(s);
    return bg_error_of([&] { write_random_checkpoint(s); });
  };
  EXPECT_NE(err([](auto& s) { s.arch = "llama"; }).find("unknown arch 'llama' (supported: deepseek_v3, kimi_k3)"),
            std::string::npos);
  EXPECT_NE(err([](auto& s) { s.preset = "huge"; }).find("unknown preset 'huge' for deepseek_v3 (choose tiny, small)"),
            std::string::npos);
  EXPECT_NE(err([](auto& s) { s.format = "int4"; }).find("unknown weight format 'int4'"), std::string::npos);
  EXPECT_NE(err([](auto& s) { s.n_shards = 0; }).find("shard count 0"), std::string::npos);
  EXPECT_NE(err([](auto& s) { s.out_dir.clear(); }).find("no output directory"), std::string::npos);
  EXPECT_NE(err([](auto& s) { s.config_patch = "x"; }).find("must be a JSON object"), std::string::npos);
  EXPECT_NE(err([](auto& s) {
              s.config_patch = json::parse(R"([{"op": "remove", "path": "/no_such_key"}])");
            }).find("JSON Patch"),
            std::string::npos);
  // The config is validated (by the loader's parser) before anything is written.
  EXPECT_NE(err([](auto& s) { s.config_patch = {{"n_group", 3}}; }).find("not divisible by n_group 3"),
            std::string::npos);
  EXPECT_NE(err([](auto& s) {
              s.format = "mxfp4";
              s.config_patch = {{"moe_intermediate_size", 48}};
            }).find("input dim 48, not a multiple of 32"),
            std::string::npos);
  EXPECT_NE(err([](auto& s) { s.n_shards = 100000; }).find("shard count"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(tmp / "m"));
}

TEST(MakeRandom, ConfigPatchMergesAndDerivedFieldsFollow) {
  RandomCheckpointSpec s = tiny_spec("unused", "fp8");
  s.config_patch = {{"q_lora_rank", nullptr},
                    {"qk_rope_head_dim", 8},
                    {"num_attention_heads", 2},
                    {"rope_parameters", {{"factor", 4.0}, {"mscale", nullptr}}}};
  json c = random_checkpoint_config(s);
  EXPECT_TRUE(c.at("q_lora_rank").is_null());
  EXPECT_EQ(c.at("head_dim"), 8);
  EXPECT_EQ(c.at("qk_head_dim"), 24);
  EXPECT_EQ(c.at("num_key_value_heads"), 2);
  EXPECT_EQ(c.at("rope_parameters").at("factor"), 4.0);
  EXPECT_TRUE(c.at("rope_parameters").at("mscale").is_null());
  EXPECT_EQ(c.at("rope_parameters").at("rope_type"), "yarn");  // untouched keys of a merged object stay
  EXPECT_EQ(c.at("quantization_config").at("weight_block_size"), json::array({128, 128}));
  EXPECT_EQ(c.at("quantization_config").at("quant_method"), "fp8");

  s.config_patch = json::parse(R"([{"op": "replace", "path": "/rope_parameters", "value": {"rope_type": "default"}},
                                   {"op": "remove", "path": "/n_group"}])");
  c = random_checkpoint_config(s);
  EXPECT_EQ(c.at("rope_parameters"), json({{"rope_type", "default"}}));
  EXPECT_FALSE(c.contains("n_group"));
}

TEST(MakeRandom, SmallPresetHasGroupedRoutingAndLoads) {
  TempDir tmp;
  RandomCheckpointSpec s = tiny_spec(tmp / "m", "mxfp4", 5);
  s.preset = "small";
  s.n_shards = 3;
  write_random_checkpoint(s);
  json c = read_json_file(tmp / "m" / "config.json");
  EXPECT_EQ(c.at("n_group"), 4);
  EXPECT_EQ(c.at("topk_group"), 2);
  EXPECT_EQ(c.at("vocab_size"), 2048);
  auto model = load_model(tmp / "m");
  EngineRun run = run_prefill_then_decode(*model, {1, 2000, 3, 1500, 7, 11}, 2);
  EXPECT_TRUE(all_finite(run.logits));
}

}  // namespace
}  // namespace bg::testing
