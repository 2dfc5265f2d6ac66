// The W4A16 layout without a GPU: the code-bit placement is a bijection and decodes to the E2M1 bf16 bits, a packed
// layer reads back bit for bit as QuantWeight::decode_all (odd shapes, padding, scale shifts, s = 0) and unpacks to
// the checkpoint's exact bytes, bad input is rejected with a message, and a host emulation of mma.m16n8k16 built from
// the PTX ISA fragment rules (not from the layout's own maps) over the kernel's shared-memory images reproduces the
// direct dot products. The split-K choice and the CPU reference are checked too.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/moe_w4a16/moe_w4a16.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"
#include "ops/moe_w4a16/moe_w4a16_schedule.h"
#include "ops/moe_w4a16/moe_w4a16_testing.h"

namespace bg::ops {
namespace {

using namespace w4_testing;

TEST(MoeW4a16Layout, CodeBitsAreABijectionAndDecodeToBf16) {
  uint32_t used = 0;
  for (int i = 0; i < 8; ++i) {
    for (int b = 0; b < 4; ++b) {
      const int src = w4::source_bit(i, b);
      ASSERT_GE(src, 0) << "element " << i << " bit " << b;
      EXPECT_EQ((used >> src) & 1u, 0u) << "source bit " << src << " used twice";
      used |= 1u << src;
    }
  }
  EXPECT_EQ(used, 0xffffffffu);
  std::mt19937 rng(1);
  for (int trial = 0; trial < 2000; ++trial) {
    uint8_t codes[8];
    uint32_t word = 0;
    for (int i = 0; i < 8; ++i) {
      codes[i] = static_cast<uint8_t>(rng() & 15);
      for (int b = 0; b < 4; ++b) word |= static_cast<uint32_t>((codes[i] >> b) & 1) << w4::source_bit(i, b);
    }
    uint32_t r[4];
    w4::decode_word(word, r);
    for (int i = 0; i < 8; ++i) {
      const auto lane = static_cast<uint16_t>(r[i / 2] >> (16 * (i % 2)));
      EXPECT_EQ(lane, static_cast<uint16_t>(((codes[i] & 8) << 12) | ((codes[i] & 7) << 6)));
      // value * 2^-126, exactly (the E = 0 code 0.5 is the bf16 subnormal 2^-127).
      EXPECT_EQ(bf16_to_f32(lane), std::ldexp(e2m1_to_f32(codes[i]), -126));
    }
  }
}

void expect_round_trip(const Layer& l) {
  for (int64_t e = 0; e < l.info.n_slots; ++e) {
    const auto i = static_cast<size_t>(e);
    const std::vector<float> want[3] = {l.gate[i].w.decode_all(), l.up[i].w.decode_all(), l.down[i].w.decode_all()};
    const std::vector<float> got[3] = {moe_w4a16_unpack(l.info, l.bytes, e, MoeW4a16Proj::kGateUp, 0),
                                       moe_w4a16_unpack(l.info, l.bytes, e, MoeW4a16Proj::kGateUp, 1),
                                       moe_w4a16_unpack(l.info, l.bytes, e, MoeW4a16Proj::kDown)};
    for (int m = 0; m < 3; ++m) {
      ASSERT_EQ(got[m].size(), want[m].size());
      for (size_t j = 0; j < want[m].size(); ++j) {
        ASSERT_EQ(got[m][j], want[m][j]) << "expert " << e << " matrix " << m << " element " << j;
      }
    }
  }
}

TEST(MoeW4a16Layout, PackUnpackRoundTripsBitExact) {
  // Odd shapes: partial items (rows padded to 256 / 512) and partial k-stages (96 = 64 + 32).
  const Layer l = make_layer(3, 96, 160, 7);
  EXPECT_EQ(l.info.gate_up.n_items, 1);
  EXPECT_EQ(l.info.gate_up.n_kstages, 2);
  EXPECT_EQ(l.info.down.n_kstages, 3);
  EXPECT_EQ(l.info.gate_up.scale_shift, 0);
  expect_round_trip(l);
  // A scale of 2^5 (s = 132) needs a shift of 4; the rest still decodes exactly.
  const Layer big = make_layer(2, 64, 288, 9, 132);
  EXPECT_EQ(big.info.gate_up.scale_shift, 4);
  EXPECT_EQ(big.info.down.scale_shift, 0);
  expect_round_trip(big);
}

// The loader packs into uninitialised memory (moe_w4a16_upload): every byte must be written, the same whatever the
// buffer held before.
TEST(MoeW4a16Layout, PackWritesEveryByte) {
  const Layer l = make_layer(3, 96, 160, 11);  // packed into zeroed memory
  std::vector<std::byte> dirty(l.bytes.size(), std::byte{0xAB});
  const MoeW4a16LayoutInfo info = moe_w4a16_pack(l.views, 96, 160, dirty);
  EXPECT_EQ(info.total_bytes, l.info.total_bytes);
  for (size_t i = 0; i < dirty.size(); ++i) ASSERT_EQ(dirty[i], l.bytes[i]) << "byte " << i << " was not written";
}

// Each expert is one block that can live anywhere (a streamed-expert buffer): packing an expert alone gives the bytes
// of its slot in the layer, and the block decodes on its own.
TEST(MoeW4a16Layout, ExpertBlocksStandAlone) {
  const Layer l = make_layer(3, 96, 160, 13, 132);  // expert 0 has a scale of 2^5: the layer's gate/up shift is 4
  EXPECT_EQ(l.info.block_bytes % 256, 0);
  EXPECT_EQ(l.info.down.offset_bytes, (l.info.gate_up.slot_bytes + 255) / 256 * 256);
  EXPECT_EQ(l.info.total_bytes, 3 * l.info.block_bytes);
  for (int64_t e = 0; e < 3; ++e) {
    const auto i = static_cast<size_t>(e);
    std::vector<std::byte> block(static_cast<size_t>(l.info.block_bytes), std::byte{0x5A});
    moe_w4a16_pack_expert(l.info, l.views[i], e, block);
    const auto* in_layer = l.bytes.data() + e * l.info.block_bytes;
    ASSERT_TRUE(std::equal(block.begin(), block.end(), in_layer)) << "expert " << e;
    const std::vector<float> down = moe_w4a16_unpack_block(l.info, block, MoeW4a16Proj::kDown);
    EXPECT_EQ(down, l.down[i].w.decode_all()) << "expert " << e;
  }
  // An expert whose scales the layer's shifts cannot hold is refused, naming the scales.
  MoeW4a16LayoutInfo no_shift = l.info;
  no_shift.gate_up.scale_shift = 0;
  std::vector<std::byte> block(static_cast<size_t>(l.info.block_bytes));
  EXPECT_THROW(moe_w4a16_pack_expert(no_shift, l.views[0], 0, block), Error);
  std::vector<std::byte> short_block(static_cast<size_t>(l.info.block_bytes - 256));
  EXPECT_THROW(moe_w4a16_pack_expert(l.info, l.views[1], 1, short_block), Error);
}

TEST(MoeW4a16Layout, RealShapesHaveNoPadding) {
  const MoeW4a16LayoutInfo k3 = moe_w4a16_layout_info(56, 3584, 3072);
  EXPECT_EQ(k3.gate_up.slot_bytes, 2 * 3072 * 3584 / 2 + 2 * 3072 * 3584 / 32);
  EXPECT_EQ(k3.down.slot_bytes, 3584 * 3072 / 2 + 3584 * 3072 / 32);
  const MoeW4a16LayoutInfo ds = moe_w4a16_layout_info(256, 7168, 2048);
  EXPECT_EQ(ds.gate_up.slot_bytes, 2 * 2048 * 7168 / 2 + 2 * 2048 * 7168 / 32);
  EXPECT_EQ(ds.down.slot_bytes, 7168 * 2048 / 2 + 7168 * 2048 / 32);
  EXPECT_EQ(k3.block_bytes, k3.gate_up.slot_bytes + k3.down.slot_bytes);
  EXPECT_EQ(ds.block_bytes, ds.gate_up.slot_bytes + ds.down.slot_bytes);
}

TEST(MoeW4a16Layout, RejectsBadInput) {
  Layer l = make_layer(1, 64, 64, 3);
  reinterpret_cast<uint8_t*>(l.up[0].scales.data())[5] = 0xff;
  EXPECT_THROW(moe_w4a16_pack(l.views, 64, 64, l.bytes), Error);
  Layer wrong = make_layer(1, 64, 64, 4);
  EXPECT_THROW(moe_w4a16_pack(wrong.views, 64, 96, wrong.bytes), Error);  // shape mismatch
  std::vector<std::byte> small(128);
  EXPECT_THROW(moe_w4a16_pack(wrong.views, 64, 64, small), Error);
  EXPECT_THROW(moe_w4a16_layout_info(4, 100, 64), Error);
}

// ---- The byte-exact inverse (moe_w4a16_unpack_expert) ---------------------------------------------------------------
// One random expert (down scales from 0; codes 0x8F / 0xF8 (-0 and 0xF) and scales 0 and 128 forced in at each
// matrix's ends) and its block, packed under its own shifts.
struct PackedExpert {
  Mxfp4 mats[3];  // gate, up, down
  MoeW4a16LayoutInfo info;
  std::vector<std::byte> block;
  MoeW4a16ExpertView view() const { return {&mats[0].w, &mats[1].w, &mats[2].w}; }
  void repack(const MoeW4a16LayoutInfo& i) {
    info = i;
    block.assign(static_cast<size_t>(info.block_bytes), std::byte{0x5A});
    moe_w4a16_pack_expert(info, view(), 0, block);
  }
};
PackedExpert pack_one(int64_t hidden, int64_t inter, uint32_t seed, int gate_s_max = -1) {
  PackedExpert p{{random_mxfp4(inter, hidden, seed, 118, gate_s_max), random_mxfp4(inter, hidden, seed + 1),
                  random_mxfp4(hidden, inter, seed + 2, 0)}, {}, {}};
  for (Mxfp4& m : p.mats) {
    auto* c = reinterpret_cast<uint8_t*>(m.codes.data());
    auto* s = reinterpret_cast<uint8_t*>(m.scales.data());
    c[0] = 0x8F;
    c[m.codes.nbytes() - 1] = 0xF8;
    s[0] = 0;
    s[m.scales.nbytes() - 1] = 128;
  }
  const MoeW4a16ExpertView v = p.view();
  p.repack(moe_w4a16_layer_info({&v, 1}, hidden, inter));
  return p;
}

// The unpacked bytes, in MoeW4a16ExpertBytes order: gate codes, gate scales, up codes, up scales, down ...
struct ExpertBytes {
  std::vector<std::byte> b[6];
  MoeW4a16ExpertBytes spans() { return {b[0], b[1], b[2], b[3], b[4], b[5]}; }
};
ExpertBytes unpack_filled(const PackedExpert& p, std::byte fill) {
  ExpertBytes out;
  for (int m = 0; m < 3; ++m) {
    out.b[2 * m].assign(p.mats[m].codes.nbytes(), fill);
    out.b[2 * m + 1].assign(p.mats[m].scales.nbytes(), fill);
  }
  moe_w4a16_unpack_expert(p.info, p.block, out.spans());
  return out;
}
// Bytes of out.b[j] that differ from the checkpoint's.
int64_t n_diff(const ExpertBytes& out, const PackedExpert& p, int j) {
  const HostTensor& want = j % 2 == 0 ? p.mats[j / 2].codes : p.mats[j / 2].scales;
  EXPECT_EQ(out.b[j].size(), want.nbytes());
  int64_t n = 0;
  for (size_t i = 0; i < out.b[j].size(); ++i) n += out.b[j][i] != want.data()[i];
  return n;
}
void expect_exact(const PackedExpert& p, std::byte fill) {
  const ExpertBytes out = unpack_filled(p, fill);
  for (int j = 0; j < 6; ++j) {
    EXPECT_EQ(n_diff(out, p, j), 0) << "output " << j << ", fill " << std::to_integer<int>(fill);
  }
}

// Runs f, which must throw an Error whose message contains `want`.
template <typename F>
void expect_error(F f, const std::string& want) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    return;
  }
  ADD_FAILURE() << "no error, want '" << want << "'";
}

TEST(MoeW4a16Unpack, GivesBackTheCheckpointBytes) {
  // hidden x inter, gate scale: 96 x 160 and 160 x 96 have padding rows and inputs (partial items and k-stages);
  // 64 x 288 has a gate scale of 2^5 (gate/up shift 4, added back); 7168 x 2048 is DeepSeek-V3's (no padding).
  struct Case {
    int64_t hidden, inter;
    int s_max;
  };
  for (const Case c : {Case{96, 160, -1}, Case{160, 96, -1}, Case{64, 288, 132}, Case{7168, 2048, -1}}) {
    const PackedExpert p = pack_one(c.hidden, c.inter, 21, c.s_max);
    EXPECT_EQ(p.info.gate_up.scale_shift, c.s_max < 0 ? 0 : 4);
    EXPECT_EQ(p.info.down.scale_shift, 0);
    // Outputs filled beforehand: a byte left unwritten shows under at least one of the two fills.
    expect_exact(p, std::byte{0xAB});
    if (c.hidden < 1024) expect_exact(p, std::byte{0x54});
  }
}

// A layer's shifts come from its largest scales, so an expert's block can be packed under more shift than it needs:
// other stored scales, the same bytes back.
TEST(MoeW4a16Unpack, AddsTheLayerShiftBack) {
  PackedExpert p = pack_one(96, 160, 23);
  const std::vector<std::byte> unshifted = p.block;
  MoeW4a16LayoutInfo info = p.info;
  info.gate_up.scale_shift = 20;
  info.down.scale_shift = 3;  // down scale 0 is stored as 123, not clamped
  p.repack(info);
  EXPECT_NE(p.block, unshifted);
  expect_exact(p, std::byte{0xAB});
}

TEST(MoeW4a16Unpack, RejectsWhatItCannotInvert) {
  PackedExpert p = pack_one(96, 160, 25);
  ExpertBytes out = unpack_filled(p, std::byte{0});
  // Wrong version, block size or output size.
  MoeW4a16LayoutInfo old = p.info;
  old.version = 1;
  expect_error([&] { moe_w4a16_unpack_expert(old, p.block, out.spans()); }, "layout version 1");
  const std::span<const std::byte> short_block(p.block.data(), p.block.size() - 256);
  expect_error([&] { moe_w4a16_unpack_expert(p.info, short_block, out.spans()); }, "block of");
  MoeW4a16ExpertBytes short_out = out.spans();
  short_out.down_scales = short_out.down_scales.first(short_out.down_scales.size() - 1);
  expect_error([&] { moe_w4a16_unpack_expert(p.info, p.block, short_out); }, "down scales span of");
  // Stored scales no packer wrote: gate row 0 group 0 (shift 0) as 0 (s = -126) and as 0xFF.
  const auto gate_s0 = static_cast<size_t>(w4::scale_offset(0, 0, 0, 0, 0));
  for (const std::byte bad : {std::byte{0}, std::byte{0xFF}}) {
    std::vector<std::byte> block = p.block;
    block[gate_s0] = bad;
    expect_error([&] { moe_w4a16_unpack_expert(p.info, block, out.spans()); }, "gate row 0 group 0 has the stored");
  }
  // Down under a shift of 127: its scale 0 is clamped (s' = max(0, -1)). The packer accepts it, the inverse cannot.
  MoeW4a16LayoutInfo clamping = p.info;
  clamping.down.scale_shift = 127;
  p.repack(clamping);
  expect_error([&] { moe_w4a16_unpack_expert(p.info, p.block, out.spans()); }, "down row 0 group 0 has the stored "
               "scale 0 under the scale shift 127: a clamped scale");
}

// The inverse reads the block: one changed code byte changes gate codes only; one scale byte + 1 gives its s + 1.
TEST(MoeW4a16Unpack, AChangedBlockByteChangesTheOutput) {
  PackedExpert p = pack_one(96, 160, 27);
  const std::vector<std::byte> original = p.block;
  p.block[0] ^= std::byte{0xFF};  // warp 0, tile 0 (gate), lane 0, word 0: gate rows 0 and 8, inputs 0..3
  const ExpertBytes flipped = unpack_filled(p, std::byte{0});
  const int64_t n_gate = n_diff(flipped, p, 0);  // the 8 flipped bits land in 1..4 of the word's 4 source bytes
  EXPECT_GE(n_gate, 1);
  EXPECT_LE(n_gate, 4);
  for (int j = 1; j < 6; ++j) EXPECT_EQ(n_diff(flipped, p, j), 0) << "output " << j;
  p.block = original;
  p.block[static_cast<size_t>(w4::scale_offset(0, 0, 0, 0, 0))] = std::byte{127};  // gate row 0 group 0: s 0 -> 1
  const ExpertBytes scaled = unpack_filled(p, std::byte{0});
  EXPECT_EQ(scaled.b[1][0], std::byte{1});
  EXPECT_EQ(n_diff(scaled, p, 1), 1);
}

// The kernel's work on slot 0 of one projection, emulated: every item, every k-stage (activation tile built as the
// producer copies it, zeros past n_in), registers extracted exactly as mma_stage does (or, with `wgmma`, the A
// registers as wgmma_stage makes them and B read from the swizzled tile as wgmma reads it), results mapped back
// through the C fragment rule (a wgmma's D rows of one warp follow it) and the layout's row maps. Returns
// [row][token]; gate/up rows: gate 0..inter-1, then up.
std::vector<double> emulate_projection(const Layer& l, MoeW4a16Proj proj, const std::vector<float>& x, int n_tok,
                                       bool wgmma = false) {
  const MoeW4a16MatrixInfo& m = proj == MoeW4a16Proj::kGateUp ? l.info.gate_up : l.info.down;
  const bool gu = proj == MoeW4a16Proj::kGateUp;
  std::vector<double> out(static_cast<size_t>((gu ? 2 : 1) * m.n_out * n_tok), 0.0);
  const auto* layout = reinterpret_cast<const uint8_t*>(l.bytes.data()) + m.offset_bytes;
  for (int item = 0; item < m.n_items; ++item) {
    for (int warp = 0; warp < w4::kWarps; ++warp) {
      for (int mt = 0; mt < w4::kMTiles; ++mt) {
        for (int nb = 0; nb < n_tok / 8; ++nb) {
          double d[16][8] = {};
          for (int kstage = 0; kstage < m.n_kstages; ++kstage) {
            const uint8_t* block = layout + (static_cast<int64_t>(item) * m.n_kstages + kstage) * w4::kStageBytes;
            std::vector<uint8_t> act(w4::kActStageBytes, 0), act_sw(w4::kActSw128Bytes, 0xEE);
            for (int r = 0; r < n_tok; ++r)
              for (int c = 0; c < 8; ++c)
                for (int j = 0; j < 8; ++j) {
                  const int64_t k = kstage * 64 + c * 8 + j;
                  const uint16_t bits = k < m.n_in ? f32_to_bf16(x[static_cast<size_t>(r * m.n_in + k)]) : 0;
                  std::memcpy(act.data() + w4::act_offset(r, c) + 2 * j, &bits, 2);
                  // The wgmma producer: word j / 2 of source chunk c, one 4-byte copy.
                  std::memcpy(act_sw.data() + w4::act_sw128_offset(r, c, j / 2) + 2 * (j & 1), &bits, 2);
                }
            for (int ks = 0; ks < 4; ++ks) {
              uint32_t a_regs[32][4], b_regs[32][2];
              for (int lane = 0; lane < 32; ++lane) {
                const int g = lane >> 2, t = lane & 3;
                uint32_t words[4], sc[2], chunk[4];
                std::memcpy(words, block + w4::code_offset(warp, mt, lane), 16);
                std::memcpy(sc, block + w4::scale_offset(warp, g, t >> 1, 0, 0), 8);
                std::memcpy(chunk, act.data() + w4::act_offset(nb * 8 + g, 2 * t + (ks >> 1)), 16);
                a_fragment(words, sc, mt, ks, a_regs[lane]);
                b_regs[lane][0] = chunk[2 * (ks & 1)];
                b_regs[lane][1] = chunk[2 * (ks & 1) + 1];
                if (wgmma) {  // B element pairs (k 2t + 8j + {0, 1}, token nb * 8 + g) as wgmma reads them
                  for (int j = 0; j < 2; ++j) {
                    std::memcpy(&b_regs[lane][j], act_sw.data() + wgmma_b_offset(nb * 8 + g, ks, 2 * t + 8 * j), 4);
                  }
                }
              }
              emulate_mma(a_regs, b_regs, d);
            }
          }
          for (int lane = 0; lane < 32; ++lane) {
            for (int i = 0; i < 4; ++i) {  // the kernel's epilogue map of c_i
              const int row16 = (lane >> 2) + (i >> 1) * 8, tok = nb * 8 + (lane & 3) * 2 + (i & 1);
              const int64_t row = gu ? w4::gate_up_column(item, warp, mt, row16) : w4::down_row(item, warp, mt, row16);
              if (row >= m.n_out) continue;
              const int64_t out_row = gu && w4::gate_up_is_up(mt) ? m.n_out + row : row;
              out[static_cast<size_t>(out_row * n_tok + tok)] = d[row16][(lane & 3) * 2 + (i & 1)] *
                                                                std::ldexp(1.0, m.scale_shift);
            }
          }
        }
      }
    }
  }
  return out;
}

TEST(MoeW4a16Layout, FragmentsMatchPtxMmaSemantics) {
  // hidden 576 / inter 288: two items per projection (the second partial), partial k-stages, 3 n8 token blocks.
  const int64_t hidden = 576, inter = 288;
  const int n_tok = 24;
  const Layer l = make_layer(1, hidden, inter, 21, 131, 118);  // gate scale shift 3
  ASSERT_EQ(l.info.gate_up.scale_shift, 3);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (MoeW4a16Proj proj : {MoeW4a16Proj::kGateUp, MoeW4a16Proj::kDown}) {
    const bool gu = proj == MoeW4a16Proj::kGateUp;
    const int64_t n_in = gu ? hidden : inter;
    std::vector<float> x(static_cast<size_t>(n_tok * n_in));
    for (auto& v : x) v = bf16_to_f32(f32_to_bf16(uni(rng)));
    for (bool wgmma : {false, true}) {
      const std::vector<double> got = emulate_projection(l, proj, x, n_tok, wgmma);
      std::vector<std::vector<float>> mats;
      if (gu) {
        mats = {l.gate[0].w.decode_all(), l.up[0].w.decode_all()};
      } else {
        mats = {l.down[0].w.decode_all()};
      }
      const int64_t n_out = gu ? inter : hidden;
      for (size_t mi = 0; mi < mats.size(); ++mi) {
        for (int64_t row = 0; row < n_out; ++row) {
          for (int tok = 0; tok < n_tok; ++tok) {
            double want = 0.0;
            for (int64_t k = 0; k < n_in; ++k) {
              want += static_cast<double>(mats[mi][static_cast<size_t>(row * n_in + k)]) *
                      x[static_cast<size_t>(tok * n_in + k)];
            }
            const double g = got[static_cast<size_t>((static_cast<int64_t>(mi) * n_out + row) * n_tok + tok)];
            ASSERT_NEAR(g, want, 1e-9 * (1.0 + std::fabs(want)))
                << (gu ? (mi ? "up" : "gate") : "down") << " row " << row << " token " << tok
                << (wgmma ? " (wgmma activations)" : "");
          }
        }
      }
    }
  }
}

TEST(MoeW4a16Layout, SplitChoiceFillsTheMachine) {
  // Kimi-K3 on an H200 (132 SMs), gate/up 12 items x 56 k-stages per expert, 1-8 rows: 16 touched experts (batch 1)
  // -> 2 splits (3 even waves of 384 half items instead of 2 uneven waves of 192), 56 experts -> none (6 waves of
  // 672 already), one expert -> 8; down (7 items x 48 k-stages) at 16 experts -> none (112 items, one wave).
  EXPECT_EQ(w4::choose_splits(16 * 12, 56, 132, 0, 1), 2);
  EXPECT_EQ(w4::choose_splits(56 * 12, 56, 132, 0, 1), 1);
  EXPECT_EQ(w4::choose_splits(12, 56, 132, 0, 1), 8);
  EXPECT_EQ(w4::choose_splits(16 * 7, 48, 132, 0, 1), 1);
  EXPECT_EQ(w4::choose_splits(12, 3, 132, 0, 1), 1);   // the partial sums would cost more than they save
  EXPECT_EQ(w4::choose_splits(12, 5, 132, 8, 4), 5);   // fixed, capped by the k-stages
  EXPECT_EQ(w4::choose_splits(5000, 56, 132, 4, 4), 4);
  for (int s = 1; s <= 8; ++s) {
    for (int n = s; n < 60; ++n) {
      for (int i = 0; i < s; ++i) EXPECT_LT(w4::split_begin(n, s, i), w4::split_begin(n, s, i + 1)) << n << " " << s;
      EXPECT_EQ(w4::split_begin(n, s, s), n);
    }
  }
}

// ---- The work list, walked for every CTA ------------------------------------------------------------------------------
struct WalkCase {
  int64_t n_tokens, top_k, n_experts, n_used, hidden, inter;
  int32_t fixed_splits;
  int grid;
  bool stream_k = true;  // without fixed splits: stream-K (the default), else the split choice
  bool narrow = true;    // MoeW4a16Params::narrow (stream-K needs a narrow launch)
};

// Every (permuted row, item, k-stage) of both projections is computed exactly once across all CTAs' schedules, split
// ranges tile the k-stages, and every slot and counter index stays inside the workspace geometry. Stream-K: every
// pass-tile cut between CTAs has its pieces on CTAs [stream_first_cta, stream_last_cta] in k order, each in the slot
// the finisher reads it from (stream_slot), and no slot holds two pieces.
void walk_schedules(const WalkCase& wc) {
  const std::string what = fmt::format("n={} k={} E={} used={} {}x{} splits={} grid={} stream-K={}", wc.n_tokens,
                                       wc.top_k, wc.n_experts, wc.n_used, wc.hidden, wc.inter, wc.fixed_splits,
                                       wc.grid, wc.stream_k);
  MoeW4a16Params p;
  p.n_tokens = wc.n_tokens;
  p.top_k = wc.top_k;
  p.n_experts = wc.n_experts;
  p.hidden = wc.hidden;
  p.inter = wc.inter;
  p.fixed_splits = wc.fixed_splits;
  p.stream_k = wc.stream_k;
  p.narrow = wc.narrow;
  const MoeW4a16WorkspaceGeometry geo = moe_w4a16_workspace_geometry(p, wc.grid);
  ASSERT_EQ(geo.stream, wc.stream_k && wc.fixed_splits == 0 && wc.n_tokens <= 32 && moe_w4a16_runs_narrow(p)) << what;
  const MoeW4a16LayoutInfo info = moe_w4a16_layout_info(wc.n_experts, wc.hidden, wc.inter);
  // Routing (distinct experts per token) and its dispatch, as moe_dispatch_cuda computes it.
  std::mt19937 rng(static_cast<uint32_t>(wc.n_tokens * 131 + wc.n_experts));
  std::vector<int32_t> counts(static_cast<size_t>(wc.n_experts), 0);
  for (int64_t t = 0; t < wc.n_tokens; ++t) {
    std::vector<int32_t> pool(static_cast<size_t>(wc.n_used));
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t j = 0; j < wc.top_k; ++j) {
      std::swap(pool[static_cast<size_t>(j)], pool[static_cast<size_t>(j + static_cast<int64_t>(rng() % static_cast<uint32_t>(wc.n_used - j)))]);
      ++counts[static_cast<size_t>(pool[static_cast<size_t>(j)])];
    }
  }
  std::vector<int32_t> offsets(1, 0), active;
  for (int64_t e = 0; e < wc.n_experts; ++e) {
    offsets.push_back(offsets.back() + counts[static_cast<size_t>(e)]);
    if (counts[static_cast<size_t>(e)] > 0) active.push_back(static_cast<int32_t>(e));
  }
  const int64_t rows = offsets.back();
  const int n_active = static_cast<int>(active.size());
  for (const MoeW4a16MatrixInfo* m : {&info.gate_up, &info.down}) {
    const w4::ScheduleParams sp = w4::schedule_params(m->n_items, m->n_kstages, geo.nb_cap, wc.fixed_splits,
                                                      wc.n_tokens, geo.stream, active.data(), offsets.data());
    w4::Plan pl = w4::make_plan(sp, n_active, wc.grid);
    // Overlapped down: the tickets' shares (CTA b below is ticket b), by the kernel's rule.
    if (m == &info.down && geo.overlap_counters > 0) {
      pl.head = w4::overlap_head(static_cast<int64_t>(n_active) * info.gate_up.n_items, wc.grid);
    }
    // Stream-K: the pass-tile prefix, as the kernel's block scan computes it.
    std::vector<int32_t> tile_first(1, 0);
    for (const int32_t e : active) {
      const int r = offsets[static_cast<size_t>(e) + 1] - offsets[static_cast<size_t>(e)];
      tile_first.push_back(tile_first.back() + w4::stream_chunks(r, pl.chunk_rows) * m->n_items);
    }
    if (pl.stream) {
      w4::set_stream_units(pl, tile_first.back(), m->n_kstages, wc.grid);
      ASSERT_LE(tile_first.back(), geo.tile_counters) << what;
    }
    std::vector<uint8_t> seen(static_cast<size_t>(rows * m->n_items * m->n_kstages), 0);
    std::set<int64_t> parallel_slots;
    std::map<int, std::vector<std::array<int, 4>>> pieces;  // stream-K pass-tile -> (cta, kb, ke, slot)
    for (int cta = 0; cta < wc.grid; ++cta) {
      // The CTA's item table, as the kernel builds it; it must fit the capacity the workspace reserved.
      std::vector<w4::ItemEntry> table;
      const int count = pl.stream ? w4::stream_count(pl, m->n_kstages, cta) : w4::items_of_cta(pl, cta, wc.grid);
      for (int k = 0; k < count; ++k) {
        table.push_back(pl.stream ? w4::make_stream_entry(sp, pl, tile_first.data(), n_active, cta, k)
                                  : w4::make_entry(sp, pl, w4::item_of_cta(pl, cta, k, wc.grid)));
      }
      if (!pl.stream && pl.head == 0) {
        int64_t n = 0;
        for (int64_t item = cta; item < pl.n_items; item += wc.grid) ++n;
        ASSERT_EQ(n, count) << what;
      }
      ASSERT_LE(static_cast<int>(table.size()), geo.table_entries) << what;
      w4::Cursor c;
      c.count = static_cast<int>(table.size());
      w4::load_item(c, sp, pl, table.data());
      for (int guard = 0; c.valid; ++guard) {
        ASSERT_LT(guard, 1 << 24) << what;
        ASSERT_FALSE(c.bad) << what;
        ASSERT_TRUE(c.nb >= 1 && c.nb <= geo.nb_cap && c.chunk_rows <= 8 * geo.nb_cap) << what;
        ASSERT_TRUE(c.ks >= c.kb && c.ks < c.ke && c.ke <= m->n_kstages) << what;
        for (int r = 0; r < c.chunk_rows; ++r) {
          const int64_t row = c.chunk_row0 + r;
          ASSERT_TRUE(row >= offsets[static_cast<size_t>(c.e)] && row < offsets[static_cast<size_t>(c.e) + 1]) << what;
          ++seen[static_cast<size_t>((row * m->n_items + c.m) * m->n_kstages + c.ks)];
        }
        if (c.ks + 1 == c.ke && w4::pass_is_partial(c, sp, pl)) {  // a pass ends: its partial slot and counter
          const int64_t slot = w4::partial_slot(c, pl, geo.seq_slot_base, cta);
          ASSERT_LT(slot, geo.partial_slots) << what;
          if (pl.stream) {
            ASSERT_LT(c.tile, geo.tile_counters) << what;
            ASSERT_TRUE(parallel_slots.insert(slot).second) << what << ": slot " << slot << " used twice";
            pieces[c.tile].push_back({cta, c.kb, c.ke, static_cast<int>(slot)});
          } else if (pl.parallel) {
            ASSERT_LT(c.tile, geo.tile_counters) << what;
            ASSERT_TRUE(parallel_slots.insert(slot).second) << what << ": slot " << slot << " used twice";
          } else {
            ASSERT_GE(slot, geo.seq_slot_base) << what;
          }
        }
        w4::advance(c, sp, pl, table.data());
      }
    }
    for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << what << " (row, item, k-stage) " << i;
    for (const auto& [tile, list] : pieces) {
      const int b0 = w4::stream_first_cta(pl, m->n_kstages, tile), b1 = w4::stream_last_cta(pl, m->n_kstages, tile);
      ASSERT_EQ(static_cast<int>(list.size()), b1 - b0 + 1) << what << " pass-tile " << tile;
      int k = 0;
      for (size_t i = 0; i < list.size(); ++i) {  // walked in CTA order: CTA b0 + i, its k-stages next
        ASSERT_EQ(list[i][0], b0 + static_cast<int>(i)) << what << " pass-tile " << tile;
        ASSERT_EQ(list[i][1], k) << what << " pass-tile " << tile;
        ASSERT_EQ(list[i][3], w4::stream_slot(pl, m->n_kstages, list[i][0], tile)) << what << " pass-tile " << tile;
        k = list[i][2];
      }
      ASSERT_EQ(k, m->n_kstages) << what << " pass-tile " << tile;
    }
    if (pl.stream) {  // the CTAs' shares differ by at most one unit, and no CTA below ctas is idle
      for (int b = 0; b < wc.grid; ++b) {
        const int share = w4::stream_begin(pl, b + 1) - w4::stream_begin(pl, b);
        if (b < pl.ctas) {
          ASSERT_TRUE(share == pl.units / pl.ctas || share == pl.units / pl.ctas + 1) << what << " CTA " << b;
          ASSERT_GE(share, std::min(pl.units, w4::kStreamMinStages)) << what;
        } else {
          ASSERT_EQ(share, 0) << what;
        }
      }
    }
  }
}

TEST(MoeW4a16Schedule, EveryStageOnceAndInsideTheWorkspace) {
  for (const bool stream : {true, false}) {
    walk_schedules({1, 16, 56, 56, 3584, 3072, 0, 132, stream});    // Kimi-K3 batch 1: 2 parallel gate/up splits
    walk_schedules({4, 16, 56, 56, 3584, 3072, 0, 132, stream});
    walk_schedules({32, 16, 56, 56, 3584, 3072, 0, 132, stream});
    walk_schedules({33, 16, 56, 56, 3584, 3072, 0, 132, stream});   // > 32 tokens: several row chunks, no splits
    walk_schedules({16, 16, 56, 56, 3584, 3072, 0, 264, stream});   // the narrow shape's grid
    walk_schedules({64, 16, 56, 56, 3584, 3072, 0, 264, stream});   // ... at 64 tokens (no stream-K)
    walk_schedules({64, 16, 56, 56, 3584, 3072, 0, 132, stream});   // the slice at 64 tokens: overlapped down
    walk_schedules({100, 8, 12, 12, 7168, 2048, 3, 132, stream});   // in-order fixed splits
    walk_schedules({20, 4, 16, 16, 512, 256, 4, 132, stream});      // fixed parallel splits
    walk_schedules({1, 1, 1, 1, 64, 64, 0, 132, stream});           // one expert: splits capped by the k-stages
    walk_schedules({5, 3, 10, 7, 96, 160, 0, 7, stream});           // odd shapes, a small grid
    walk_schedules({7, 2, 4, 4, 64, 96, 8, 3, stream});
    walk_schedules({300, 8, 64, 20, 256, 128, 0, 132, stream});     // up to ~10 row chunks per expert
    walk_schedules({16, 8, 256, 256, 7168, 2048, 0, 132, stream});  // DeepSeek-V3, all 256 experts: 15 pieces
  }
}

// Where down overlaps gate/up's last wave, and how the tickets share down's items: the CTAs that start while gate/up's
// last wave runs (overlap_head of them) take one item more, first; every item once.
TEST(MoeW4a16Schedule, OverlapChoiceAndTickets) {
  MoeW4a16Params p;
  p.n_tokens = 33;
  EXPECT_TRUE(moe_w4a16_overlaps(p));
  p.n_tokens = 32;  // parallel splits / stream-K share counters between the launches
  EXPECT_FALSE(moe_w4a16_overlaps(p));
  p.n_tokens = 64;
  p.pdl = false;  // down is not a programmatic dependent: nothing to overlap
  EXPECT_FALSE(moe_w4a16_overlaps(p));
  p.pdl = true;
  p.overlap = false;
  EXPECT_FALSE(moe_w4a16_overlaps(p));
  p.overlap = true;
  p.rows_out = true;
  EXPECT_TRUE(moe_w4a16_overlaps(p));

  EXPECT_EQ(w4::overlap_head(672, 132), 120);  // Kimi-K3 at 64 tokens: 12 gate/up CTAs run a sixth item
  EXPECT_EQ(w4::overlap_head(660, 132), 132);  // even waves: no late CTAs
  EXPECT_EQ(w4::overlap_head(100, 132), 32);   // 100 busy CTAs, 32 idle from the start
  EXPECT_EQ(w4::overlap_head(0, 132), 132);
  for (const auto& [n_items, head, grid] : std::vector<std::array<int, 3>>{
           {392, 120, 132}, {392, 132, 132}, {50, 120, 132}, {121, 120, 132}, {7, 3, 5}, {1, 1, 1}}) {
    w4::Plan pl;
    pl.n_items = n_items;
    pl.head = head;
    std::vector<int> seen(static_cast<size_t>(n_items), 0);
    for (int cta = 0; cta < grid; ++cta) {
      const int count = w4::items_of_cta(pl, cta, grid);
      for (int k = 0; k < count; ++k) {
        const int item = w4::item_of_cta(pl, cta, k, grid);
        ASSERT_TRUE(item >= 0 && item < n_items) << n_items << " " << head << " " << grid;
        ++seen[static_cast<size_t>(item)];
        if (k > 0) {
          EXPECT_GT(item, w4::item_of_cta(pl, cta, k - 1, grid));  // in order: expert by expert
        }
      }
      if (n_items == 392 && head == 120) {  // 3 or 4 items on an early ticket, 2 or 3 on a late one
        EXPECT_TRUE(cta < head ? count == 3 || count == 4 : count == 2 || count == 3) << cta << ": " << count;
      }
    }
    for (int i = 0; i < n_items; ++i) ASSERT_EQ(seen[static_cast<size_t>(i)], 1) << n_items << " item " << i;
  }
}

// The combine in the down launch up to 32 tokens, in a kernel of its own above (or as asked); none with rows out.
TEST(MoeW4a16Schedule, CombineChoice) {
  MoeW4a16Params p;
  p.n_tokens = 32;
  EXPECT_FALSE(moe_w4a16_separate_combine(p));
  p.n_tokens = 33;
  EXPECT_TRUE(moe_w4a16_separate_combine(p));
  p.combine = MoeW4a16Combine::kFused;
  EXPECT_FALSE(moe_w4a16_separate_combine(p));
  p.n_tokens = 1;
  p.combine = MoeW4a16Combine::kSeparate;
  EXPECT_TRUE(moe_w4a16_separate_combine(p));
  p.rows_out = true;  // the exchange combines
  EXPECT_FALSE(moe_w4a16_separate_combine(p));
}

// The narrow shape (asked for, mma.sync): up to 16 tokens.
TEST(MoeW4a16Schedule, NarrowShapeChoice) {
  const auto narrow = [](int64_t n_tokens, int64_t top_k, int64_t experts, bool asked = true, bool wgmma = false) {
    MoeW4a16Params p;
    p.n_tokens = n_tokens;
    p.top_k = top_k;
    p.n_experts = experts;
    p.hidden = 3584;
    p.inter = 3072;
    p.narrow = asked;
    p.wgmma = wgmma;
    return moe_w4a16_runs_narrow(p);
  };
  EXPECT_TRUE(narrow(1, 16, 56));
  EXPECT_TRUE(narrow(16, 16, 56));
  EXPECT_TRUE(narrow(16, 8, 256));
  EXPECT_FALSE(narrow(17, 16, 56));
  EXPECT_FALSE(narrow(64, 16, 56));  // 18.3 rows per expert: the wide shape (since 2026-12-06)
  EXPECT_FALSE(narrow(8, 16, 56, false));
  EXPECT_FALSE(narrow(8, 16, 56, true, true));
}

// The item table's capacity per CTA (shared memory beside the pipeline): the most items CTA 0 takes over every
// touched-expert count, by the kernel's own plan; under stream-K (up to 32 tokens) the most pass-tiles a CTA's run of
// units touches, at most (share - 1) / k-stages + 2. Kimi-K3 and a DeepSeek-V3 rank holding all 256 experts on 132 SMs.
TEST(MoeW4a16Schedule, ItemTableCapacity) {
  const auto entries = [](int64_t n_tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t inter,
                          bool stream) {
    MoeW4a16Params p;
    p.n_tokens = n_tokens;
    p.top_k = top_k;
    p.n_experts = experts;
    p.hidden = hidden;
    p.inter = inter;
    p.stream_k = stream;
    p.narrow = true;
    return moe_w4a16_workspace_geometry(p, 132).table_entries;
  };
  EXPECT_EQ(entries(1, 16, 56, 3584, 3072, false), 4);    // 16 experts: gate/up 192 tiles x 2 splits = 384 items
  EXPECT_EQ(entries(64, 16, 56, 3584, 3072, false), 6);   // 56 experts x 12 gate/up items = 672 items
  EXPECT_EQ(entries(512, 8, 256, 7168, 2048, false), 28); // 256 x 14 = 3584 items
  EXPECT_EQ(entries(1, 8, 256, 7168, 2048, false), 3);
  EXPECT_EQ(entries(1, 16, 56, 3584, 3072, true), 3);   // stream-K (narrow launches up to 32 tokens)
  EXPECT_EQ(entries(16, 16, 56, 3584, 3072, true), 7);  // 56 experts: 672 pass-tiles of 56 k-stages on 132 CTAs
  EXPECT_EQ(entries(64, 16, 56, 3584, 3072, true), 6);  // more tokens: the whole items above
  EXPECT_EQ(entries(1, 8, 256, 7168, 2048, true), 2);
  EXPECT_EQ(entries(16, 8, 256, 7168, 2048, true), 15);
  MoeW4a16Params big;
  big.n_tokens = 1;
  big.top_k = 1;
  big.n_experts = 1;
  big.hidden = int64_t{1} << 21;  // past the packing bounds of the item table
  big.inter = 64;
  EXPECT_THROW(moe_w4a16_workspace_geometry(big, 132), Error);
}

TEST(MoeW4a16Cpu, ReferenceMatchesDirectFormula) {
  const int64_t hidden = 64, inter = 96, n = 3, k = 2;
  const Layer l = make_layer(4, hidden, inter, 31, -1, 118);
  std::vector<float> x(static_cast<size_t>(n * hidden));
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (auto& v : x) v = bf16_to_f32(f32_to_bf16(uni(rng)));
  const std::vector<int32_t> ids = {0, 3, 1, 0, 2, 3};
  const std::vector<float> wts = {0.7f, 0.3f, 0.5f, 0.5f, 1.0f, 0.25f};
  MoeW4a16Params p;
  p.n_tokens = n;
  p.top_k = k;
  p.n_experts = 4;
  p.hidden = hidden;
  p.inter = inter;
  p.act = MoeW4a16Act::kSiTU;
  std::vector<float> out(static_cast<size_t>(n * hidden), 0.0f);
  moe_w4a16_cpu(p, l.views, x.data(), ids.data(), wts.data(), out.data());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < hidden; ++o) {
      double want = 0.0;
      for (int64_t s = 0; s < k; ++s) {
        const auto e = static_cast<size_t>(ids[static_cast<size_t>(t * k + s)]);
        const std::vector<float> g = l.gate[e].w.decode_all(), u = l.up[e].w.decode_all(), d = l.down[e].w.decode_all();
        double y = 0.0;
        for (int64_t i = 0; i < inter; ++i) {
          double gd = 0.0, ud = 0.0;
          for (int64_t j = 0; j < hidden; ++j) {
            gd += static_cast<double>(g[static_cast<size_t>(i * hidden + j)]) * x[static_cast<size_t>(t * hidden + j)];
            ud += static_cast<double>(u[static_cast<size_t>(i * hidden + j)]) * x[static_cast<size_t>(t * hidden + j)];
          }
          const double act = 4.0 * std::tanh(gd / 4.0) / (1.0 + std::exp(-gd)) * 25.0 * std::tanh(ud / 25.0);
          y += static_cast<double>(d[static_cast<size_t>(o * inter + i)]) * act;
        }
        want += wts[static_cast<size_t>(t * k + s)] * y;
      }
      // The reference rounds h to bf16 (as the kernel stores it): within 2^-8 relative per term.
      EXPECT_NEAR(out[static_cast<size_t>(t * hidden + o)], want, 2e-2 * (1.0 + std::fabs(want)));
    }
  }
}

}  // namespace
}  // namespace bg::ops
