// The store layout (expert blocks, alignment, segments, NUMA spread), placement from the architecture tables, and the
// manifest's encoding and its validating decoder against malformed input.
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "model/model_testing.h"
#include "weights/placement.h"
#include "weights/store_builder.h"
#include "weights/store_layout.h"
#include "weights/expert_pack.h"
#include "weights_testing.h"

namespace bg::testing {
namespace {

using namespace bg::weights;

Manifest plan_for(const std::string& golden_case, uint64_t segment_max = uint64_t{8} << 30, int numa = 1) {
  StoreInput in = scan_model(golden_model(golden_case), nullptr);
  return plan_layout(in.tensors, in.sources, {segment_max, numa}, {in.arch, in.config_xxh64, 7});
}

TEST(Placement, ClassifiesTensorsOfBothArchitectures) {
  const Placement ds = Placement::for_model(golden_model("deepseek_v3/tiny-fp8"));
  TensorPlacement p = ds.classify("model.layers.1.mlp.experts.3.gate_proj.weight");
  EXPECT_EQ(p.kind, GroupKind::kExpert);
  EXPECT_EQ(p.layer, 1);
  EXPECT_EQ(p.expert, 3);
  const TensorPlacement scale = ds.classify("model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv");
  EXPECT_EQ(scale.kind, GroupKind::kExpert);
  EXPECT_EQ(scale.order, p.order + 1);  // codes before scales
  const TensorPlacement up = ds.classify("model.layers.1.mlp.experts.3.up_proj.weight");
  EXPECT_GT(up.order, scale.order);      // gate before up
  EXPECT_EQ(ds.classify("model.embed_tokens.weight").kind, GroupKind::kGlobal);
  p = ds.classify("model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
  EXPECT_EQ(p.kind, GroupKind::kLayer);
  EXPECT_EQ(p.layer, 0);
  p = ds.classify("model.layers.61.eh_proj.weight");  // outside the table (MTP): by the layer in its name
  EXPECT_EQ(p.kind, GroupKind::kLayer);
  EXPECT_EQ(p.layer, 61);
  EXPECT_EQ(ds.classify("lm_head.weight").kind, GroupKind::kGlobal);
  const Placement k3 = Placement::for_model(golden_model("kimi_k3/k3-tiny"));
  p = k3.classify("language_model.model.layers.2.block_sparse_moe.experts.15.w2.weight_packed");
  EXPECT_EQ(p.kind, GroupKind::kExpert) << k3.table().specs.front().pattern;
  EXPECT_EQ(p.expert, 15);
}

TEST(Placement, MatchPatternParsesLayerAndExpert) {
  int64_t l = 0, e = 0;
  EXPECT_TRUE(match_pattern("a.{L}.b.{E}.c", "a.12.b.345.c", &l, &e));
  EXPECT_EQ(l, 12);
  EXPECT_EQ(e, 345);
  EXPECT_FALSE(match_pattern("a.{L}.b", "a..b", &l, &e));
  EXPECT_FALSE(match_pattern("a.{L}.b", "a.1.bc", &l, &e));
  EXPECT_FALSE(match_pattern("a.{L}", "a.x", &l, &e));
}

// Each (layer, expert) is one 4 KiB-aligned block holding exactly its gate/up/down parts in table order, every tensor
// 256-byte aligned, and the block is found in O(1) by (layer, expert).
TEST(PlanLayout, ExpertBlocksAreContiguousAlignedAndAddressable) {
  for (const std::string c : {"kimi_k3/k3-tiny", "deepseek_v3/tiny-fp8", "deepseek_v3/tiny-mxfp4"}) {
    const Manifest m = plan_for(c);
    size_t n_blocks = 0;
    for (size_t gi = 0; gi < m.groups.size(); ++gi) {
      const GroupInfo& g = m.groups[gi];
      EXPECT_EQ(g.offset % 4096, 0u) << c;
      EXPECT_EQ(g.bytes % 4096, 0u) << c;
      if (g.kind != GroupKind::kExpert) continue;
      ++n_blocks;
      EXPECT_EQ(m.expert_block(g.layer, g.expert), static_cast<int32_t>(gi));
      std::vector<const TensorInfo*> parts;
      for (const TensorInfo& t : m.tensors) {
        if (t.group == gi) parts.push_back(&t);
      }
      ASSERT_GE(parts.size(), 3u) << c;
      uint64_t prev_end = g.offset;
      for (const TensorInfo* t : parts) {
        EXPECT_EQ(t->offset % 256, 0u) << t->name;
        EXPECT_GE(t->offset, prev_end) << t->name;
        EXPECT_LT(t->offset - prev_end, 256u) << t->name;  // only alignment padding between parts
        EXPECT_NE(t->name.find(".experts." + std::to_string(g.expert) + "."), std::string::npos) << t->name;
        prev_end = t->offset + t->bytes;
      }
      EXPECT_LE(prev_end, g.offset + g.bytes);
      EXPECT_NE(parts.front()->name.find(c.find("kimi") == 0 ? ".w1." : ".gate_proj."), std::string::npos)
          << parts.front()->name;
    }
    EXPECT_GT(n_blocks, 0u) << c;
    EXPECT_EQ(m.expert_block(0, 0), -1) << "layer 0 is dense";
    EXPECT_EQ(m.expert_block(99, 0), -1);
  }
}

TEST(PlanLayout, GroupsNeverStraddleSegmentsAndSpreadOverNumaNodes) {
  const Manifest one = plan_for("kimi_k3/k3-tiny");
  ASSERT_EQ(one.segments.size(), 1u);
  const Manifest m = plan_for("kimi_k3/k3-tiny", 64 << 10, 2);
  EXPECT_GT(m.segments.size(), 4u);
  for (const GroupInfo& g : m.groups) {
    EXPECT_LE(g.offset + g.bytes, m.segments[g.segment].bytes);
    // A group only exceeds the segment size limit when it is alone in its segment.
    if (g.bytes + kSegmentHeaderBytes > (64u << 10)) {
      EXPECT_EQ(g.offset, kSegmentHeaderBytes);
    }
  }
  for (size_t s = 0; s < m.segments.size(); ++s) EXPECT_EQ(m.segments[s].numa_node, static_cast<int>(s % 2));
  EXPECT_EQ(one.tensors.size(), m.tensors.size());
}

TEST(Manifest, EncodeDecodeRoundTrip) {
  Manifest m = plan_for("deepseek_v3/tiny-fp8", 100 << 10);
  for (size_t i = 0; i < m.tensors.size(); ++i) m.tensors[i].xxh64 = 0x1234 + i;
  const auto bytes = encode_manifest(m);
  const Manifest d = decode_manifest(bytes, "test");
  ASSERT_EQ(d.tensors.size(), m.tensors.size());
  EXPECT_EQ(d.generation, 7u);
  EXPECT_EQ(d.arch, m.arch);
  EXPECT_EQ(d.sources, m.sources);
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    EXPECT_EQ(d.tensors[i].name, m.tensors[i].name);
    EXPECT_EQ(d.tensors[i].shape, m.tensors[i].shape);
    EXPECT_EQ(d.tensors[i].offset, m.tensors[i].offset);
    EXPECT_EQ(d.tensors[i].xxh64, m.tensors[i].xxh64);
  }
  EXPECT_EQ(encode_manifest(d), bytes);
}

std::string decode_error(const Manifest& m) {
  return bg_error_of([&] { decode_manifest(encode_manifest(m), "manifest"); });
}

TEST(Manifest, DecoderRejectsEveryInconsistency) {
  const Manifest good = plan_for("deepseek_v3/tiny-fp8");
  const auto bytes = encode_manifest(good);
  for (size_t cut : {size_t{0}, size_t{5}, bytes.size() / 2, bytes.size() - 1}) {
    const std::string e = bg_error_of([&] { decode_manifest(std::span(bytes).subspan(0, cut), "m"); });
    EXPECT_TRUE(e.find("truncated") != std::string::npos || e.find("does not fit") != std::string::npos) << e;
  }
  auto extra = bytes;
  extra.push_back(std::byte{0});
  EXPECT_NE(bg_error_of([&] { decode_manifest(extra, "m"); }).find("bytes left"), std::string::npos);
  Manifest m = good;
  m.tensors[3].offset = m.segments[0].bytes;  // outside its segment
  EXPECT_NE(decode_error(m).find("outside its group"), std::string::npos);
  m = good;
  m.tensors[3].offset += 4;  // unaligned
  EXPECT_NE(decode_error(m).find("outside its group"), std::string::npos);
  m = good;
  m.tensors[3].bytes += 1;  // bytes != shape x dtype
  EXPECT_NE(decode_error(m).find("needs"), std::string::npos);
  m = good;
  m.tensors[4].name = m.tensors[3].name;
  EXPECT_NE(decode_error(m).find("appears twice"), std::string::npos);
  m = good;
  m.groups[1].offset = m.groups[0].offset;  // overlapping groups
  EXPECT_NE(decode_error(m).find("overlap"), std::string::npos);
  m = good;
  m.groups[1].segment = 9;
  EXPECT_NE(decode_error(m).find("segment 9"), std::string::npos);
  m = good;
  m.tensors[2].source = 99;
  EXPECT_NE(decode_error(m).find("source 99"), std::string::npos);
  // A count far beyond the bytes that follow is refused before anything is allocated.
  auto huge = bytes;
  const uint32_t n = 0xffffffffu;
  const size_t count_at = 8 + 4 + good.arch.size() + 8 + 1 + 4;  // generation, arch, config hash, expert layout
  std::memcpy(huge.data() + count_at, &n, 4);
  EXPECT_NE(bg_error_of([&] { decode_manifest(huge, "m"); }).find("does not fit"), std::string::npos);
}

// A store with W4A16 blocks: every packed expert group must be whole and consistent.
TEST(Manifest, DecoderChecksPackedExperts) {
  TempDir tmp;
  BuildOptions o;
  o.progress_tty = 0;
  o.expert_layout = ExpertLayout::kW4a16;
  const Manifest good =
      build_store(scan_model(golden_model("deepseek_v3/tiny-mxfp4"), nullptr), StoreTarget::dir(tmp.path()), o)
          .manifest;
  ASSERT_FALSE(good.packed.empty());
  EXPECT_EQ(decode_manifest(encode_manifest(good), "m").packed.size(), good.packed.size());
  const PackedExpert& pe = good.packed.begin()->second;
  Manifest m = good;
  m.tensors[pe.parts[1]].role = TensorRole::kStored;
  EXPECT_NE(decode_error(m).find("stored inside packed group"), std::string::npos) << decode_error(m);
  m = good;
  m.tensors[pe.parts[3]].role = TensorRole::kGateScales;  // two gate scales, no up scales
  EXPECT_NE(decode_error(m).find("lacks a part"), std::string::npos) << decode_error(m);
  m = good;
  m.tensors[pe.block].shape = {m.tensors[pe.block].shape[0] + 256};
  m.tensors[pe.block].bytes += 256;
  EXPECT_NE(decode_error(m).find("W4A16 block"), std::string::npos) << decode_error(m);
  m = good;
  m.w4a16_version = 1;
  EXPECT_NE(decode_error(m).find("layout version 1"), std::string::npos) << decode_error(m);
  m = good;
  m.tensors[pe.parts[4]].offset += 256;  // a packed part names no place of its own
  EXPECT_NE(decode_error(m).find("does not name its group's place"), std::string::npos) << decode_error(m);
  m = good;
  m.tensors[pe.block].role = TensorRole::kStored;  // parts without their block
  EXPECT_NE(decode_error(m).find("packed group"), std::string::npos) << decode_error(m);
  auto bytes = encode_manifest(good);
  bytes[8 + 4 + good.arch.size() + 8] = std::byte{7};  // the expert layout byte
  EXPECT_NE(bg_error_of([&] { decode_manifest(bytes, "m"); }).find("unknown expert layout"), std::string::npos);
}

}  // namespace
}  // namespace bg::testing
