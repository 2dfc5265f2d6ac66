// Checkpoint: single-file and sharded (model.safetensors.index.json) layouts, and every index inconsistency.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "formats/checkpoint.h"
#include "formats/formats_testing.h"
#include "formats/safetensors.h"

namespace bg {
namespace {

using testing::expect_error;
using testing::TempDir;
using testing::write_bytes;

constexpr const char* kShard1 = "model-00001-of-00002.safetensors";
constexpr const char* kShard2 = "model-00002-of-00002.safetensors";

HostTensor filled(std::vector<float> values) {
  Shape shape = {static_cast<int64_t>(values.size())};
  return HostTensor::from_f32(values, shape);
}

void write_index(const TempDir& dir, const nlohmann::json& weight_map) {
  nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", weight_map}};
  write_bytes(dir / "model.safetensors.index.json", index.dump());
}

// Two shards: a, b in the first; c (2-D), empty and scalar in the second.
struct ShardedFixture {
  TempDir dir;
  HostTensor a = filled({1, 2, 3});
  HostTensor b = filled({4});
  HostTensor c = HostTensor::from_f32(std::vector<float>{5, 6, 7, 8}, {2, 2});
  HostTensor empty = HostTensor(DType::kBF16, {0});
  HostTensor scalar = HostTensor::from_i64(std::vector<int64_t>{42}, {});

  ShardedFixture() {
    write_safetensors(dir / kShard1, {{"a", a.view()}, {"b", b.view()}});
    write_safetensors(dir / kShard2, {{"c", c.view()}, {"empty", empty.view()}, {"scalar", scalar.view()}});
  }
  nlohmann::json good_map() const {
    return {{"a", kShard1}, {"b", kShard1}, {"c", kShard2}, {"empty", kShard2}, {"scalar", kShard2}};
  }
};

TEST(Checkpoint, ShardedReadsBackExactly) {
  ShardedFixture fx;
  write_index(fx.dir, fx.good_map());
  auto ckpt = Checkpoint::open(fx.dir.path());
  EXPECT_EQ(ckpt->names(), (std::vector<std::string>{"a", "b", "c", "empty", "scalar"}));
  EXPECT_EQ(ckpt->get("a").to_f32(), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(ckpt->get("b").to_f32(), (std::vector<float>{4}));
  EXPECT_EQ(ckpt->get("c").to_f32(), (std::vector<float>{5, 6, 7, 8}));
  EXPECT_EQ(ckpt->get("c").shape, (Shape{2, 2}));
  EXPECT_EQ(ckpt->get("empty").numel(), 0);
  EXPECT_EQ(ckpt->get("empty").dtype, DType::kBF16);
  EXPECT_EQ(ckpt->get("scalar").rank(), 0);
  EXPECT_EQ(ckpt->get("scalar").to_i64(), (std::vector<int64_t>{42}));
  EXPECT_EQ(ckpt->file_of("a"), kShard1);
  EXPECT_EQ(ckpt->file_of("c"), kShard2);
  EXPECT_EQ(ckpt->file_of("zzz"), "<none>");
  EXPECT_FALSE(ckpt->find("zzz").has_value());
  EXPECT_TRUE(ckpt->contains("scalar"));
  expect_error([&] { ckpt->get("zzz"); }, {"missing tensor 'zzz'", fx.dir.path().string()});
}

TEST(Checkpoint, SingleFileDirAndPath) {
  TempDir dir;
  HostTensor a = filled({1.5f, -2.0f});
  write_safetensors(dir / "model.safetensors", {{"a", a.view()}});
  auto from_dir = Checkpoint::open(dir.path());
  EXPECT_EQ(from_dir->get("a").to_f32(), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(from_dir->file_of("a"), "model.safetensors");
  auto from_file = Checkpoint::open(dir / "model.safetensors");
  EXPECT_EQ(from_file->get("a").to_f32(), (std::vector<float>{1.5f, -2.0f}));
}

TEST(Checkpoint, MissingPathsAreErrors) {
  TempDir dir;
  expect_error([&] { Checkpoint::open(dir / "nope"); }, {"does not exist", "nope"});
  expect_error([&] { Checkpoint::open(dir.path()); },
               {"neither model.safetensors.index.json nor model.safetensors", dir.path().string()});
}

TEST(Checkpoint, MissingShardFile) {
  ShardedFixture fx;
  auto map = fx.good_map();
  map["c"] = "model-00003-of-00003.safetensors";
  write_index(fx.dir, map);
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {"cannot open", "model-00003-of-00003.safetensors"});
}

TEST(Checkpoint, ShardNamesMustBePlainFileNames) {
  const std::vector<std::string> bad = {"../model-00001-of-00002.safetensors", "sub/x.safetensors", "..", ".", "",
                                       "a\\b.safetensors", std::string("model.safetensors\0x", 19)};
  for (const auto& shard : bad) {
    SCOPED_TRACE(shard);
    ShardedFixture fx;
    auto map = fx.good_map();
    map["a"] = shard;
    write_index(fx.dir, map);
    expect_error([&] { Checkpoint::open(fx.dir.path()); }, {"model.safetensors.index.json", "not a plain file name"});
  }
}

TEST(Checkpoint, IndexMapsTensorToShardThatLacksIt) {
  ShardedFixture fx;
  auto map = fx.good_map();
  map["c"] = kShard1;
  write_index(fx.dir, map);
  expect_error([&] { Checkpoint::open(fx.dir.path()); },
               {"index maps 'c' to " + std::string(kShard1) + ", which does not hold it"});
}

TEST(Checkpoint, IndexNamesTensorNoShardHas) {
  ShardedFixture fx;
  auto map = fx.good_map();
  map["ghost"] = kShard2;
  write_index(fx.dir, map);
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {"'ghost'", "does not hold it"});
}

TEST(Checkpoint, ShardTensorMissingFromIndex) {
  ShardedFixture fx;
  auto map = fx.good_map();
  map.erase("scalar");
  write_index(fx.dir, map);
  expect_error([&] { Checkpoint::open(fx.dir.path()); },
               {kShard2, "tensor 'scalar' is not listed in model.safetensors.index.json"});
}

TEST(Checkpoint, TensorStoredInTwoShards) {
  ShardedFixture fx;
  HostTensor other = filled({9});
  // Shard 2 also holds 'b'; the index maps 'b' to shard 1, so shard 2's copy would be silently ignored.
  write_safetensors(fx.dir / kShard2, {{"b", other.view()},
                                       {"c", fx.c.view()},
                                       {"empty", fx.empty.view()},
                                       {"scalar", fx.scalar.view()}});
  write_index(fx.dir, fx.good_map());
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {"tensor 'b' is also stored in", kShard2, "maps it to"});
}

TEST(Checkpoint, MalformedIndex) {
  ShardedFixture fx;
  auto index_path = fx.dir / "model.safetensors.index.json";
  write_bytes(index_path, R"({"metadata":{},"weight_map":["a"]})");
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {index_path.string(), "missing object 'weight_map'"});
  write_bytes(index_path, R"({"metadata":{"total_size":12}})");
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {"missing object 'weight_map'"});
  write_bytes(index_path, R"({"weight_map":"model.safetensors"})");
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {"missing object 'weight_map'"});
  write_bytes(index_path, R"([1, 2])");
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {index_path.string(), "not a JSON object"});
  write_bytes(index_path, R"({"weight_map": {"a": )");
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {index_path.string(), "not valid JSON"});
  write_bytes(index_path, R"({"weight_map": {"a": 1}})");
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {"weight_map['a'] is not a string"});
}

TEST(Checkpoint, CorruptShardNamesTheShard) {
  ShardedFixture fx;
  write_index(fx.dir, fx.good_map());
  write_bytes(fx.dir / kShard2, testing::raw_safetensors("{\"c\": 5}", ""));
  expect_error([&] { Checkpoint::open(fx.dir.path()); }, {kShard2, "tensor 'c'", "not a JSON object"});
}

}  // namespace
}  // namespace bg
