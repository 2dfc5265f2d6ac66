// A weight store holding MXFP4 experts as W4A16 blocks (--expert-layout w4a16): the blocks are the GPU kernel's bytes,
// the checkpoint tensors come back exactly (and checked), corruption is caught and repaired, adoption respects the
// layout, convert writes and reads it, and the engine computes the same logits through it.
#include <gtest/gtest.h>

#include <cstring>

#include "formats/checkpoint.h"
#include "golden/golden_runner.h"
#include "model/model_testing.h"
#include "model/arch_table.h"
#include "model/model.h"
#include "ops/moe_w4a16/moe_w4a16.h"
#include "weights/convert.h"
#include "weights/expert_pack.h"
#include "weights/placement.h"
#include "weights/store_builder.h"
#include "weights/store_source.h"
#include "store_checks.h"
#include "weights_testing.h"

namespace bg::testing {
namespace {

using namespace bg::weights;

BuildOptions w4a16_build() {
  BuildOptions o;
  o.layout.segment_max_bytes = uint64_t{1} << 20;
  o.progress_tty = 0;
  o.expert_layout = ExpertLayout::kW4a16;
  return o;
}

// The expert's W4A16 block exactly as the kernel's host packer makes it from the checkpoint.
std::vector<std::byte> packed_from_checkpoint(const Checkpoint& ckpt, const std::string& prefix,
                                              const std::array<const char*, 3>& projs, int64_t hidden,
                                              int64_t inter) {
  const QuantWeight gate = load_linear(ckpt, prefix + projs[0], inter, hidden);
  const QuantWeight up = load_linear(ckpt, prefix + projs[1], inter, hidden);
  const QuantWeight down = load_linear(ckpt, prefix + projs[2], hidden, inter);
  const ops::MoeW4a16ExpertView ex{&gate, &up, &down};
  const ops::MoeW4a16LayoutInfo info = ops::moe_w4a16_layout_info(1, hidden, inter);
  std::vector<std::byte> block(static_cast<size_t>(info.block_bytes));
  ops::moe_w4a16_pack_expert(info, ex, 0, block);
  return block;
}

TEST(W4a16Store, BlocksAreTheKernelsBytesAndTheCheckpointComesBackExactly) {
  StoreGuard g;
  const auto model = golden_model("deepseek_v3/tiny-mxfp4");
  const StoreInput in = scan_model(model, nullptr);
  BuiltStore b = build_store(in, StoreTarget::shm(g.name()), w4a16_build());
  EXPECT_EQ(b.report.w4a16_kept, 0) << b.report.w4a16_first_kept;
  size_t n_expert_groups = 0;
  for (const GroupInfo& gi : b.manifest.groups) n_expert_groups += gi.kind == GroupKind::kExpert;
  ASSERT_GT(n_expert_groups, 0u);
  EXPECT_EQ(b.manifest.packed.size(), n_expert_groups) << "every MXFP4 expert of the golden model is packed";
  EXPECT_EQ(b.report.w4a16_packed, static_cast<int64_t>(n_expert_groups));
  EXPECT_EQ(b.manifest.expert_layout, ExpertLayout::kW4a16);
  EXPECT_EQ(b.manifest.w4a16_version, ops::kMoeW4a16LayoutVersion);
  b.segments.clear();

  auto src = StoreSource::open_shm(g.name(), 0);
  expect_same_tensors(*src, model, /*aligned=*/false);
  for (const std::string& n : src->names()) EXPECT_EQ(n.find("w4a16_block"), std::string::npos) << n;
  EXPECT_FALSE(src->contains(w4a16_block_name(1, 3)));
  EXPECT_FALSE(src->find(w4a16_block_name(1, 3)).has_value());

  auto ckpt = Checkpoint::open(model);
  const auto blk = src->w4a16_expert(1, 3);
  ASSERT_TRUE(blk.has_value());
  EXPECT_EQ(blk->hidden, 128);
  EXPECT_EQ(blk->inter, 64);
  EXPECT_EQ(blk->version, ops::kMoeW4a16LayoutVersion);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(blk->bytes.data()) % 4096, 0u) << "one aligned block: one DMA";
  const std::vector<std::byte> want =
      packed_from_checkpoint(*ckpt, "model.layers.1.mlp.experts.3.", {"gate_proj", "up_proj", "down_proj"}, 128, 64);
  ASSERT_EQ(blk->bytes.size(), want.size());
  EXPECT_EQ(std::memcmp(blk->bytes.data(), want.data(), want.size()), 0);
  EXPECT_FALSE(src->w4a16_expert(0, 0).has_value()) << "layer 0 is dense";
}

TEST(W4a16Store, KimiK3ExpertsPackInTableOrder) {
  StoreGuard g;
  const auto model = golden_model("kimi_k3/k3-tiny");
  BuiltStore b = build_store(scan_model(model, nullptr), StoreTarget::shm(g.name()), w4a16_build());
  EXPECT_GT(b.report.w4a16_packed, 0);
  EXPECT_EQ(b.report.w4a16_kept, 0) << b.report.w4a16_first_kept;
  b.segments.clear();
  auto src = StoreSource::open_shm(g.name(), 0);
  expect_same_tensors(*src, model, /*aligned=*/false);
  // Gate is w1, up is w3, down is w2 (the table's order, which the engine's MoE uses).
  const auto blk = src->w4a16_expert(1, 15);
  ASSERT_TRUE(blk.has_value());
  auto ckpt = Checkpoint::open(model);
  const std::vector<std::byte> want = packed_from_checkpoint(
      *ckpt, "language_model.model.layers.1.block_sparse_moe.experts.15.", {"w1", "w3", "w2"}, blk->hidden, blk->inter);
  ASSERT_EQ(blk->bytes.size(), want.size());
  EXPECT_EQ(std::memcmp(blk->bytes.data(), want.data(), want.size()), 0);
}

TEST(W4a16Store, ACorruptBlockIsCaughtOnUseAndRepackedFromTheCheckpoint) {
  StoreGuard g;
  const auto model = golden_model("deepseek_v3/tiny-mxfp4");
  const StoreInput in = scan_model(model, nullptr);
  build_store(in, StoreTarget::shm(g.name()), w4a16_build());
  const std::string block_name = w4a16_block_name(2, 5);
  {
    auto src = StoreSource::open_shm(g.name(), 0);
    const TensorInfo& t = src->manifest().tensors[src->manifest().by_name.at(block_name)];
    MappedSegment seg = MappedSegment::open_shm(shm_segment_name(g.name(), t.segment), /*writable=*/true);
    seg.data()[t.offset + 100] ^= std::byte{0x10};  // a code bit of some part
  }
  // An engine unpacking it finds the damage (the part no longer matches its checksum).
  EXPECT_NE(bg_error_of([&] { StoreSource::open_shm(g.name(), 0)->find("model.layers.2.mlp.experts.5.gate_proj."
                                                                        "weight_blocks"); })
                .find("is corrupt"),
            std::string::npos);
  // Adoption verifies the block's checksum, and the repair re-packs it from the checkpoint's parts.
  AdoptResult a = open_for_adoption(g.name(), in.tensors, in.arch, in.config_xxh64, ExpertLayout::kW4a16, 2, 0);
  ASSERT_TRUE(a.adopted) << a.not_adopted;
  ASSERT_EQ(a.corrupt.size(), 1u);
  EXPECT_EQ(a.manifest.tensors[a.corrupt[0]].name, block_name);
  repair_from_input(in, a, a.corrupt, {});
  EXPECT_TRUE(verify_store(a.manifest, a.segments, 2, 0).empty());
  a.segments.clear();
  expect_same_tensors(*StoreSource::open_shm(g.name(), 0), model, false);
  // A store of the other expert layout is not adopted (rebuilt instead): the layout is what the user asked for.
  AdoptResult other = open_for_adoption(g.name(), in.tensors, in.arch, in.config_xxh64, ExpertLayout::kCheckpoint, 1,
                                        0);
  EXPECT_FALSE(other.adopted);
  EXPECT_NE(other.not_adopted.find("w4a16 layout"), std::string::npos) << other.not_adopted;
}

TEST(W4a16Store, ExpertsTheLayoutCannotHoldExactlyStayAsStored) {
  TempDir tmp;
  const auto model = golden_model("deepseek_v3/tiny-mxfp4");
  for (const auto& e : std::filesystem::directory_iterator(model)) {
    std::filesystem::copy_file(e.path(), tmp / e.path().filename());
  }
  // Raise one scale of expert 4 in layer 1 above 2^1: the kernel would need a layer-wide scale shift for it.
  const std::string victim = "model.layers.1.mlp.experts.4.down_proj.weight_scales";
  bool edited = false;
  for (const auto& e : std::filesystem::directory_iterator(tmp.path())) {
    if (e.path().extension() != ".safetensors") continue;
    uint64_t at = 0;
    {
      auto f = SafetensorsFile::open(e.path());
      for (const SafetensorsEntry& t : f->header().entries) {
        if (t.name != victim) continue;
        at = t.file_offset;
        edited = true;
      }
    }
    if (at != 0) MappedSegment::open_file(e.path(), /*writable=*/true).data()[at] = std::byte{130};
  }
  ASSERT_TRUE(edited);
  StoreGuard g;
  BuiltStore b = build_store(scan_model(tmp.path(), nullptr), StoreTarget::shm(g.name()), w4a16_build());
  EXPECT_EQ(b.report.w4a16_kept, 1);
  EXPECT_NE(b.report.w4a16_first_kept.find("layer 1 expert 4"), std::string::npos) << b.report.w4a16_first_kept;
  b.segments.clear();
  auto src = StoreSource::open_shm(g.name(), 0);
  EXPECT_FALSE(src->w4a16_expert(1, 4).has_value());
  EXPECT_TRUE(src->w4a16_expert(1, 5).has_value());
  expect_same_tensors(*src, tmp.path(), false);
}

TEST(W4a16Store, ConvertWritesTheLayoutAndReadsItBack) {
  TempDir tmp;
  const auto model = golden_model("kimi_k3/k3-tiny");
  const auto store_dir = tmp / "store", back = tmp / "back";
  ConvertOptions o;
  o.in = model;
  o.out = store_dir;
  o.store_layout = true;
  o.w4a16_experts = true;
  o.segment_max_bytes = 256 << 10;
  o.progress_tty = 0;
  const ConvertReport r = convert_checkpoint(o);
  EXPECT_GT(r.w4a16_packed, 0);
  EXPECT_EQ(r.w4a16_kept, 0);
  auto src = StoreSource::open_dir(store_dir);
  EXPECT_EQ(src->manifest().expert_layout, ExpertLayout::kW4a16);
  EXPECT_EQ(static_cast<int64_t>(src->manifest().packed.size()), r.w4a16_packed);
  expect_same_tensors(*src, model, /*aligned=*/false);
  // Back to safetensors: byte for byte the original tensors.
  ConvertOptions o2;
  o2.in = store_dir;
  o2.out = back;
  o2.progress_tty = 0;
  convert_checkpoint(o2);
  expect_same_tensors(*Checkpoint::open(back), model, false);
  // weightd loads the directory as it is (its blocks read, not re-packed) and adopts it under its own layout.
  StoreGuard g;
  const StoreInput in = scan_model(store_dir, nullptr);
  ASSERT_TRUE(in.prebuilt.has_value());
  BuildOptions quiet;
  quiet.progress_tty = 0;
  BuiltStore shm = build_store(in, StoreTarget::shm(g.name()), quiet);
  EXPECT_EQ(shm.manifest.packed.size(), src->manifest().packed.size());
  shm.segments.clear();
  expect_same_tensors(*StoreSource::open_shm(g.name(), 0), model, false);
  // Bad input: the W4A16 layout is a store layout.
  ConvertOptions bad = o;
  bad.out = tmp / "bad";
  bad.store_layout = false;
  EXPECT_NE(bg_error_of([&] { convert_checkpoint(bad); }).find("needs --layout store"), std::string::npos);
}

// A CUDA engine binds such experts deferred: the block as it is, no checkpoint bytes until something asks for them.
TEST(W4a16Store, DeferredBindGivesTheBlockAndResolvesToTheCheckpointBytes) {
  StoreGuard g;
  const auto model = golden_model("kimi_k3/k3-tiny");
  build_store(scan_model(model, nullptr), StoreTarget::shm(g.name()), w4a16_build());
  std::shared_ptr<const WeightSource> src = StoreSource::open_shm(g.name(), 0);
  const ArchTable table = weights::arch_table_for(model);
  const ModelWeights deferred = ModelWeights::bind(src, table, {.defer_w4a16_experts = true});
  const ModelWeights eager = ModelWeights::bind(src, table);
  auto ckpt = Checkpoint::open(model);
  int64_t n_deferred = 0;
  deferred.for_each_linear([&](uint64_t key, const QuantWeight& w) {
    const ModelWeights::KeyParts k = ModelWeights::split_key(key);
    const QuantWeight& e = eager.linear_by_key(key);
    EXPECT_FALSE(e.deferred()) << e.name;
    if (k.expert < 0) {
      EXPECT_FALSE(w.deferred()) << w.name;
      return;
    }
    ++n_deferred;
    ASSERT_TRUE(w.deferred()) << w.name;
    EXPECT_EQ(w.data.data, nullptr);
    EXPECT_EQ(w.data.nbytes, e.data.nbytes);
    EXPECT_EQ(w.scale.nbytes, e.scale.nbytes);
    const auto blk = src->w4a16_expert(k.layer, k.expert);
    ASSERT_TRUE(blk.has_value());
    EXPECT_EQ(w.w4a16.block.data(), blk->bytes.data());
    const QuantWeight r = w.resolved();
    ASSERT_FALSE(r.deferred());
    const QuantWeight c = load_linear(*ckpt, w.name, w.n_out, w.n_in);
    ASSERT_EQ(r.data.nbytes, c.data.nbytes);
    EXPECT_EQ(std::memcmp(r.data.data, c.data.data, c.data.nbytes), 0) << w.name;
    EXPECT_EQ(std::memcmp(r.scale.data, c.scale.data, c.scale.nbytes), 0) << w.name;
  });
  EXPECT_GT(n_deferred, 0);
  EXPECT_TRUE(bind_options(LoadOptions{}).defer_w4a16_experts);
}

// An engine unpacks only the experts it uses: none at load when every expert streams, then those routed to; every
// one of its resident experts when they are prepared.
TEST(W4a16Store, OnlyTheExpertsAnEngineUsesAreUnpacked) {
  StoreGuard g;
  const auto model = golden_model("kimi_k3/k3-tiny");
  DaemonOptions dopt = daemon_options(model, g.name());
  dopt.build.expert_layout = ExpertLayout::kW4a16;
  InProcessDaemon d(dopt);
  ASSERT_EQ(d.wait_ready(), "");
  const int64_t n_blocks = store_status(g.name())["w4a16_blocks"].get<int64_t>();
  ASSERT_GT(n_blocks, 0);
  GoldenCase gc(golden_dir() / "kimi_k3/k3-tiny");
  LoadOptions o = load_options(g.name());
  o.resident_experts = 0.0;
  uint64_t before = StoreSource::experts_unpacked();
  auto streamed = load_model(model, o);
  EXPECT_EQ(StoreSource::experts_unpacked() - before, 0u) << "every expert streams: nothing unpacked at load";
  run_prefill_then_decode(*streamed, gc.prompt(0).prompt, 2);
  const uint64_t used = StoreSource::experts_unpacked() - before;
  EXPECT_GT(used, 0u);
  EXPECT_LE(used, static_cast<uint64_t>(n_blocks));
  std::printf("resident 0: %lu of %ld experts unpacked after a prompt\n", static_cast<unsigned long>(used),
              static_cast<long>(n_blocks));
  before = StoreSource::experts_unpacked();
  auto resident = load_model(model, load_options(g.name()));
  EXPECT_EQ(StoreSource::experts_unpacked() - before, static_cast<uint64_t>(n_blocks));
}

class GoldenThroughW4a16Store : public ::testing::TestWithParam<std::string> {};

// The MXFP4 golden cases through a W4A16 store: the reference logits (CPU, within the golden tolerance) and exactly
// the logits of the files read directly, with every expert resident, half of them and all of them streamed.
TEST_P(GoldenThroughW4a16Store, MatchesReferenceAndDirectRead) {
  StoreGuard g;
  DaemonOptions dopt = daemon_options(golden_model(GetParam()), g.name());
  dopt.build.expert_layout = ExpertLayout::kW4a16;
  InProcessDaemon d(dopt);
  ASSERT_EQ(d.wait_ready(), "");
  const auto st = store_status(g.name());
  EXPECT_EQ(st["expert_layout"], "w4a16");
  EXPECT_GT(st["w4a16_blocks"].get<int64_t>(), 0);
  EXPECT_EQ(st["w4a16_blocks"], st["expert_blocks"]);
  check_golden_through_store(GetParam(), g.name(), {1.0, 0.5, 0.0});
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenThroughW4a16Store,
                         ::testing::Values("deepseek_v3/tiny-mxfp4", "kimi_k3/k3-tiny", "kimi_k3/k3-tiny-long"),
                         [](const auto& param_info) { return golden_case_test_name(param_info.param); });

}  // namespace
}  // namespace bg::testing
