// Host side of the W4A16 expert layout: geometry, the builder (QuantWeight views -> one layer's bytes), its byte-exact
// inverse (a block -> the checkpoint's bytes) and the reader that decodes a layout exactly as the kernel does (tests,
// debugging). Index maps: moe_w4a16_layout.h.
#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/moe_w4a16/moe_w4a16.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"
#include "ops/moe_w4a16/moe_w4a16_schedule.h"

namespace bg::ops {
namespace {

int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

MoeW4a16MatrixInfo matrix_info(int64_t n_out, int64_t n_in, int64_t rows_per_item, int64_t offset) {
  MoeW4a16MatrixInfo m;
  m.n_out = n_out;
  m.n_in = n_in;
  m.n_items = static_cast<int32_t>(w4::ceil_div(n_out, rows_per_item));
  m.n_kstages = static_cast<int32_t>(w4::ceil_div(n_in, w4::kKStage));
  m.offset_bytes = offset;
  m.slot_bytes = static_cast<int64_t>(m.n_items) * m.n_kstages * w4::kStageBytes;
  return m;
}

// contribution[i][c]: the stored-word bits of 4-bit code c at element i (OR of 8 of these = one word).
using EncodeTable = std::array<std::array<uint32_t, 16>, 8>;
EncodeTable make_encode_table() {
  EncodeTable t{};
  for (int i = 0; i < 8; ++i) {
    for (int c = 0; c < 16; ++c) {
      for (int b = 0; b < 4; ++b) {
        if ((c >> b) & 1) t[i][c] |= 1u << w4::source_bit(i, b);
      }
    }
  }
  return t;
}

// The matrix (0 gate, 1 up, 2 down) and row that tile row (item, warp, mt, r16) holds; matrix -1 past the real rows
// (padding). Shared by the packer and its inverse.
struct TileRow {
  int matrix = -1;
  int64_t row = 0;
};
TileRow tile_row(MoeW4a16Proj proj, int64_t n_out, int item, int warp, int mt, int r16) {
  if (proj == MoeW4a16Proj::kGateUp) {
    const int64_t col = w4::gate_up_column(item, warp, mt, r16);
    if (col >= n_out) return {};
    return {w4::gate_up_is_up(mt) ? 1 : 0, col};
  }
  const int64_t row = w4::down_row(item, warp, mt, r16);
  if (row >= n_out) return {};
  return {2, row};
}

// The source matrix and row that tile row (item, warp, mt, r16) holds; nullptr past the real rows (padding).
struct RowRef {
  const QuantWeight* w = nullptr;
  int64_t row = 0;
};
RowRef row_ref(const MoeW4a16ExpertView& ex, MoeW4a16Proj proj, int64_t n_out, int item, int warp, int mt, int r16) {
  const TileRow r = tile_row(proj, n_out, item, warp, mt, r16);
  const QuantWeight* mats[3] = {ex.gate, ex.up, ex.down};
  return r.matrix < 0 ? RowRef{} : RowRef{mats[r.matrix], r.row};
}

uint8_t scale_at(const RowRef& r, int64_t group) {
  if (r.w == nullptr || group >= r.w->n_in / kMxfp4GroupSize) return 0;
  return reinterpret_cast<const uint8_t*>(r.w->scale.data)[r.row * (r.w->n_in / kMxfp4GroupSize) + group];
}

// s' = s + 126 - shift, clamped at 0 (only when one projection's scales span more than 2^252: such weights are
// below 2^-125 and decode to 0).
uint8_t stored_scale(uint8_t s, int32_t shift) {
  return static_cast<uint8_t>(std::clamp(static_cast<int>(s) + 126 - shift, 0, 254));
}

void check_expert(const MoeW4a16ExpertView& ex, int64_t slot, int64_t hidden, int64_t inter) {
  const QuantWeight* mats[3] = {ex.gate, ex.up, ex.down};
  const char* names[3] = {"gate", "up", "down"};
  const int64_t outs[3] = {inter, inter, hidden}, ins[3] = {hidden, hidden, inter};
  for (int i = 0; i < 3; ++i) {
    const QuantWeight* w = mats[i];
    BG_CHECK(w != nullptr, "moe_w4a16_pack: expert {} has no {} weight", slot, names[i]);
    BG_CHECK(w->format == WeightFormat::kMxfp4, "moe_w4a16_pack: expert {} {} ('{}') is {}, not mxfp4", slot, names[i],
             w->name, weight_format_name(w->format));
    BG_CHECK(w->n_out == outs[i] && w->n_in == ins[i], "moe_w4a16_pack: expert {} {} ('{}') is [{}, {}], want [{}, {}]",
             slot, names[i], w->name, w->n_out, w->n_in, outs[i], ins[i]);
    BG_CHECK(w->data.data != nullptr && w->data.numel() * static_cast<int64_t>(dtype_size_bytes(w->data.dtype)) ==
                                            w->n_out * w->n_in / 2,
             "moe_w4a16_pack: expert {} {} ('{}'): codes are not {} bytes", slot, names[i], w->name,
             w->n_out * w->n_in / 2);
    BG_CHECK(w->scale.data != nullptr && w->scale.numel() == w->n_out * (w->n_in / kMxfp4GroupSize) &&
                 dtype_size_bytes(w->scale.dtype) == 1,
             "moe_w4a16_pack: expert {} {} ('{}'): scales are not [{}, {}] bytes", slot, names[i], w->name, w->n_out,
             w->n_in / kMxfp4GroupSize);
  }
}

// Largest E8M0 exponent of one matrix; throws on 0xFF (NaN scale: the format says the whole group is NaN).
int max_scale(const QuantWeight& w, int64_t slot, const char* name) {
  const auto* s = reinterpret_cast<const uint8_t*>(w.scale.data);
  const int64_t groups = w.n_in / kMxfp4GroupSize;
  int best = 0;
  for (int64_t i = 0; i < w.n_out * groups; ++i) {
    BG_CHECK(s[i] != 0xff, "moe_w4a16_pack: expert {} {} ('{}') row {} group {} has the E8M0 scale 0xFF (NaN): the "
             "checkpoint is corrupt", slot, name, w.name, i / groups, i % groups);
    best = std::max(best, static_cast<int>(s[i]));
  }
  return best;
}

// contribution of a source byte (two codes, k even in the low nibble, k + 1 in the high one) to a stored word, for
// each of the word's four element pairs: pair p holds elements 2p, 2p + 1 (element_k: consecutive k, one byte;
// element_row_half: p odd is row g + 8; p >= 2 is the next byte of the row). OR of 4 of these = one word.
using PairTable = std::array<std::array<uint32_t, 256>, 4>;
PairTable make_pair_table(const EncodeTable& enc) {
  PairTable t{};
  for (int p = 0; p < 4; ++p) {
    for (int b = 0; b < 256; ++b) t[p][b] = enc[2 * p][b & 0xf] | enc[2 * p + 1][b >> 4];
  }
  return t;
}

// The 8 code bytes (16 inputs) a lane's thread t reads for its 4 k-steps of one row: inputs 16 t .. 16 t + 15 of the
// stage (stage_k), i.e. bytes 8 t .. 8 t + 7 of the stage's 32; zeros past the real rows or inputs (n_in is a multiple
// of 32, so a thread's 16 inputs are all real or all padding).
std::array<uint8_t, 8> lane_row_bytes(const RowRef& r, int kstage, int t) {
  std::array<uint8_t, 8> b{};
  const int64_t k0 = static_cast<int64_t>(kstage) * w4::kKStage + 16 * t;
  if (r.w == nullptr || k0 >= r.w->n_in) return b;
  const auto* row = reinterpret_cast<const uint8_t*>(r.w->data.data) + r.row * (r.w->n_in / 2);
  std::memcpy(b.data(), row + k0 / 2, b.size());
  return b;
}

// One (slot, item, k-stage) block of 17408 bytes.
void pack_block(const MoeW4a16ExpertView& ex, MoeW4a16Proj proj, const MoeW4a16MatrixInfo& m, int item, int kstage,
                const PairTable& pairs, uint8_t* block) {
  static_assert(w4::kKStage == 64, "lane_row_bytes: 16 inputs per thread of 4");
  for (int warp = 0; warp < w4::kWarps; ++warp) {
    for (int mt = 0; mt < w4::kMTiles; ++mt) {
      for (int g = 0; g < 8; ++g) {
        const RowRef row_g = row_ref(ex, proj, m.n_out, item, warp, mt, g);
        const RowRef row_g8 = row_ref(ex, proj, m.n_out, item, warp, mt, g + 8);
        for (int t = 0; t < 4; ++t) {
          const std::array<uint8_t, 8> a = lane_row_bytes(row_g, kstage, t), b = lane_row_bytes(row_g8, kstage, t);
          uint32_t words[4];
          for (int ks = 0; ks < 4; ++ks) {  // k-step ks: inputs 16 t + 4 ks .. + 3 = bytes 2 ks, 2 ks + 1
            words[ks] = pairs[0][a[2 * ks]] | pairs[1][b[2 * ks]] | pairs[2][a[2 * ks + 1]] | pairs[3][b[2 * ks + 1]];
          }
          std::memcpy(block + w4::code_offset(warp, mt, g * 4 + t), words, sizeof(words));
        }
      }
    }
    for (int g = 0; g < 8; ++g) {
      for (int q = 0; q < 2; ++q) {
        for (int mt = 0; mt < w4::kMTiles; ++mt) {
          for (int rh = 0; rh < 2; ++rh) {
            const RowRef r = row_ref(ex, proj, m.n_out, item, warp, mt, g + 8 * rh);
            const uint8_t s = scale_at(r, static_cast<int64_t>(kstage) * 2 + q);
            block[w4::scale_offset(warp, g, q, mt, rh)] = r.w == nullptr ? 0 : stored_scale(s, m.scale_shift);
          }
        }
      }
    }
  }
}

// Stage block i of an expert's block (gate/up's n_items x n_kstages first, then down's), item-major as laid out
// (moe_w4a16_pack_expert's and moe_w4a16_unpack_expert's unit of parallel work).
struct StageRef {
  MoeW4a16Proj proj = MoeW4a16Proj::kGateUp;
  const MoeW4a16MatrixInfo* m = nullptr;
  int item = 0, kstage = 0;
  int64_t offset_bytes = 0;  // from the start of the expert's block
};
int64_t n_stage_blocks(const MoeW4a16MatrixInfo& m) { return static_cast<int64_t>(m.n_items) * m.n_kstages; }
StageRef stage_ref(const MoeW4a16LayoutInfo& info, int64_t i) {
  const bool gu = i < n_stage_blocks(info.gate_up);
  StageRef s;
  s.proj = gu ? MoeW4a16Proj::kGateUp : MoeW4a16Proj::kDown;
  s.m = gu ? &info.gate_up : &info.down;
  const int64_t in_proj = gu ? i : i - n_stage_blocks(info.gate_up);
  s.item = static_cast<int>(in_proj / s.m->n_kstages);
  s.kstage = static_cast<int>(in_proj % s.m->n_kstages);
  s.offset_bytes = s.m->offset_bytes + in_proj * w4::kStageBytes;
  return s;
}

// ---- The byte-exact inverse of pack_block (moe_w4a16_unpack_expert) -------------------------------------------------
// The inverse of PairTable: [j][v] = what byte j (bits 8 j .. 8 j + 7) of a stored word holding v gives back of the
// word's 4 source bytes, source byte p (pair p: element 2 p in the low nibble, 2 p + 1 in the high one) in bits
// 8 p .. 8 p + 7. The code bits are a permutation (source_bit), so the OR over j of these = the 4 source bytes.
using UnpairTable = std::array<std::array<uint32_t, 256>, 4>;
UnpairTable make_unpair_table() {
  UnpairTable t{};
  for (int i = 0; i < 8; ++i) {
    for (int b = 0; b < 4; ++b) {
      const int src = w4::source_bit(i, b), dst = 8 * (i >> 1) + 4 * (i & 1) + b;
      for (int v = 0; v < 256; ++v) {
        if ((v >> (src & 7)) & 1) t[src >> 3][v] |= 1u << dst;
      }
    }
  }
  return t;
}

// Where an expert's checkpoint bytes go, by TileRow::matrix: codes [n_out, n_in / 2], scales [n_out, n_in / 32].
struct ExpertOut {
  uint8_t* codes[3] = {};
  uint8_t* scales[3] = {};
};

// The codes of one stage block back into bytes 32 kstage .. 32 kstage + 31 of its real rows. A code byte's two
// elements (k even, k + 1) sit in one word as one pair (element_k, element_row_half), and no other stage block holds
// these rows and inputs, so stage blocks write disjoint bytes and can run in parallel.
void unpack_stage_codes(const uint8_t* block, const StageRef& st, const UnpairTable& unpair, const ExpertOut& out) {
  const MoeW4a16MatrixInfo& m = *st.m;
  for (int warp = 0; warp < w4::kWarps; ++warp) {
    for (int mt = 0; mt < w4::kMTiles; ++mt) {
      for (int g = 0; g < 8; ++g) {
        uint8_t* rows[2];  // this stage's code bytes of rows g, g + 8 (row half rh); nullptr for padding rows
        for (int rh = 0; rh < 2; ++rh) {
          const TileRow r = tile_row(st.proj, m.n_out, st.item, warp, mt, g + 8 * rh);
          rows[rh] = r.matrix < 0 ? nullptr
                                  : out.codes[r.matrix] + r.row * (m.n_in / 2) + st.kstage * (w4::kKStage / 2);
        }
        for (int t = 0; t < 4; ++t) {
          // As lane_row_bytes: n_in is a multiple of 32, so a thread's 16 inputs are all real or all padding.
          if (static_cast<int64_t>(st.kstage) * w4::kKStage + 16 * t >= m.n_in) continue;
          uint32_t words[4];
          std::memcpy(words, block + w4::code_offset(warp, mt, g * 4 + t), sizeof(words));
          for (int ks = 0; ks < 4; ++ks) {
            const uint32_t w = words[ks];
            const uint32_t src =
                unpair[0][w & 0xffu] | unpair[1][(w >> 8) & 0xffu] | unpair[2][(w >> 16) & 0xffu] | unpair[3][w >> 24];
            for (int p = 0; p < 4; ++p) {
              uint8_t* row = rows[w4::element_row_half(2 * p)];
              if (row != nullptr) row[w4::element_k(t, ks, 2 * p) / 2] = static_cast<uint8_t>(src >> (8 * p));
            }
          }
        }
      }
    }
  }
}

// A stored scale that does not give a checkpoint byte back (matrix -1: none), and the stage block it is in.
struct BadScale {
  int matrix = -1;
  int64_t row = 0, group = 0, stage_idx = 0;
  int s_prime = 0;
};

// The scales of one stage block back into groups 2 kstage, 2 kstage + 1 of its real rows (disjoint between stage
// blocks, as the codes). s = s' - 126 + shift inverts stored_scale unless the packer clamped (s' = 0 under a shift) or
// the byte was never the packer's (s' = 255, or s outside 0..254). Returns the first such scale; its byte is left
// unwritten (the caller throws: an exception must not leave a worker thread).
BadScale unpack_stage_scales(const uint8_t* block, const StageRef& st, const ExpertOut& out) {
  const MoeW4a16MatrixInfo& m = *st.m;
  const int64_t groups = m.n_in / kMxfp4GroupSize;
  BadScale bad;
  for (int warp = 0; warp < w4::kWarps; ++warp) {
    for (int g = 0; g < 8; ++g) {
      for (int q = 0; q < 2; ++q) {
        const int64_t group = static_cast<int64_t>(st.kstage) * 2 + q;
        if (group >= groups) continue;  // padding inputs
        for (int mt = 0; mt < w4::kMTiles; ++mt) {
          for (int rh = 0; rh < 2; ++rh) {
            const TileRow r = tile_row(st.proj, m.n_out, st.item, warp, mt, g + 8 * rh);
            if (r.matrix < 0) continue;  // padding rows
            const int s_prime = block[w4::scale_offset(warp, g, q, mt, rh)];
            const int s = s_prime - 126 + m.scale_shift;
            if (s_prime > 254 || s < 0 || s > 254 || (s_prime == 0 && m.scale_shift > 0)) {
              if (bad.matrix < 0) bad = {r.matrix, r.row, group, 0, s_prime};
              continue;
            }
            out.scales[r.matrix][r.row * groups + group] = static_cast<uint8_t>(s);
          }
        }
      }
    }
  }
  return bad;
}

}  // namespace

MoeW4a16LayoutInfo moe_w4a16_layout_info(int64_t n_slots, int64_t hidden, int64_t inter) {
  BG_CHECK(n_slots > 0, "moe_w4a16: {} expert slots", n_slots);
  BG_CHECK(hidden > 0 && inter > 0 && hidden % kMxfp4GroupSize == 0 && inter % kMxfp4GroupSize == 0,
           "moe_w4a16: hidden {} and inter {} must be positive multiples of 32 (MXFP4 groups)", hidden, inter);
  MoeW4a16LayoutInfo info;
  info.n_slots = n_slots;
  info.hidden = hidden;
  info.inter = inter;
  info.gate_up = matrix_info(inter, hidden, w4::kItemHCols, 0);
  info.down = matrix_info(hidden, inter, w4::kItemRows, align256(info.gate_up.slot_bytes));
  info.block_bytes = align256(info.down.offset_bytes + info.down.slot_bytes);
  info.total_bytes = n_slots * info.block_bytes;
  return info;
}

MoeW4a16LayoutInfo moe_w4a16_layer_info(std::span<const MoeW4a16ExpertView> experts, int64_t hidden, int64_t inter) {
  MoeW4a16LayoutInfo info = moe_w4a16_layout_info(static_cast<int64_t>(experts.size()), hidden, inter);
  int max_gu = 0, max_dn = 0;
  for (size_t e = 0; e < experts.size(); ++e) {
    const int64_t slot = static_cast<int64_t>(e);
    check_expert(experts[e], slot, hidden, inter);
    max_gu = std::max({max_gu, max_scale(*experts[e].gate, slot, "gate"), max_scale(*experts[e].up, slot, "up")});
    max_dn = std::max(max_dn, max_scale(*experts[e].down, slot, "down"));
  }
  // The kernel's bf16 scale 2^(s' - 127) must stay finite: s' <= 254 needs s - shift <= 128.
  info.gate_up.scale_shift = std::max(0, max_gu - 128);
  info.down.scale_shift = std::max(0, max_dn - 128);
  return info;
}

void moe_w4a16_pack_expert(const MoeW4a16LayoutInfo& info, const MoeW4a16ExpertView& expert, int64_t slot,
                           std::span<std::byte> block) {
  BG_CHECK(static_cast<int64_t>(block.size()) == info.block_bytes, "moe_w4a16_pack_expert: block of {} bytes, the "
           "layout's is {}", block.size(), info.block_bytes);
  check_expert(expert, slot, info.hidden, info.inter);
  const int max_gu = std::max(max_scale(*expert.gate, slot, "gate"), max_scale(*expert.up, slot, "up"));
  const int max_dn = max_scale(*expert.down, slot, "down");
  BG_CHECK(max_gu - info.gate_up.scale_shift <= 128 && max_dn - info.down.scale_shift <= 128,
           "moe_w4a16_pack_expert: expert {} has scales up to 2^{} / 2^{}, the layer's layout holds 2^{} / 2^{}", slot,
           max_gu - 127, max_dn - 127, info.gate_up.scale_shift + 1, info.down.scale_shift + 1);
  static const PairTable pairs = make_pair_table(make_encode_table());
  auto* base = reinterpret_cast<uint8_t*>(block.data());
  // Every stage block is written whole; only the alignment gaps after the two projections need zeros.
  const int64_t gu_end = info.gate_up.offset_bytes + info.gate_up.slot_bytes;
  const int64_t dn_end = info.down.offset_bytes + info.down.slot_bytes;
  std::memset(base + gu_end, 0, static_cast<size_t>(info.down.offset_bytes - gu_end));
  std::memset(base + dn_end, 0, static_cast<size_t>(info.block_bytes - dn_end));
  parallel_for(n_stage_blocks(info.gate_up) + n_stage_blocks(info.down), 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const StageRef st = stage_ref(info, i);
      pack_block(expert, st.proj, *st.m, st.item, st.kstage, pairs, base + st.offset_bytes);
    }
  });
}

MoeW4a16LayoutInfo moe_w4a16_pack(std::span<const MoeW4a16ExpertView> experts, int64_t hidden, int64_t inter,
                                  std::span<std::byte> dst) {
  const MoeW4a16LayoutInfo info = moe_w4a16_layer_info(experts, hidden, inter);
  BG_CHECK(static_cast<int64_t>(dst.size()) == info.total_bytes, "moe_w4a16_pack: destination has {} bytes, the "
           "layout needs {}", dst.size(), info.total_bytes);
  for (int64_t s = 0; s < info.n_slots; ++s) {
    const auto block = static_cast<size_t>(info.block_bytes);
    moe_w4a16_pack_expert(info, experts[static_cast<size_t>(s)], s, dst.subspan(static_cast<size_t>(s) * block, block));
  }
  return info;
}

bool moe_w4a16_separate_combine(const MoeW4a16Params& p) {
  if (p.rows_out || p.combine == MoeW4a16Combine::kFused) return false;
  return p.combine == MoeW4a16Combine::kSeparate || p.n_tokens > kMoeW4a16FusedCombineMaxTokens;
}

bool moe_w4a16_runs_narrow(const MoeW4a16Params& p) {
  return p.narrow && !p.wgmma && p.n_tokens <= kMoeW4a16NarrowMaxTokens;
}

bool moe_w4a16_overlaps(const MoeW4a16Params& p) {
  return p.overlap && p.pdl && !moe_w4a16_runs_narrow(p) && p.n_tokens > w4::kChunkRows;
}

MoeW4a16WorkspaceGeometry moe_w4a16_workspace_geometry(const MoeW4a16Params& p, int grid) {
  moe_w4a16_check_params(p);
  BG_CHECK(grid > 0, "moe_w4a16: grid of {} CTAs", grid);
  MoeW4a16WorkspaceGeometry s;
  const MoeW4a16LayoutInfo info = moe_w4a16_layout_info(p.n_experts, p.hidden, p.inter);
  s.rows = p.n_tokens * p.top_k;
  s.nb_cap = static_cast<int32_t>(std::clamp<int64_t>((p.n_tokens + 7) / 8, 1, w4::kMaxNb));
  s.slot_floats = static_cast<int64_t>(w4::kMTiles) * s.nb_cap * w4::kThreads * 4;
  const int64_t max_active = std::min(p.n_experts, std::max<int64_t>(s.rows, 1));
  s.tile_counters = max_active * std::max(info.gate_up.n_items, info.down.n_items);
  s.token_counters = p.rows_out ? 0 : p.n_tokens * info.down.n_items;  // rows out: no combine
  s.overlap_counters = moe_w4a16_overlaps(p) ? p.n_experts + 2 : 0;
  // Stream-K (the narrow shape up to 32 tokens, where it replaces the parallel splits): every touched expert is one
  // pass-tile per item (its rows are at most n_tokens <= the chunk rows); within the 32-bit bound of the schedule's
  // arithmetic.
  s.stream = p.stream_k && p.fixed_splits == 0 && p.n_tokens <= w4::kChunkRows && moe_w4a16_runs_narrow(p);
  for (const MoeW4a16MatrixInfo* m : {&info.gate_up, &info.down}) {
    if (max_active * m->n_items * m->n_kstages * (grid + 1) >= (int64_t{1} << 31)) s.stream = false;
  }
  if (s.stream) {
    s.partial_slots = 2 * static_cast<int64_t>(grid);
    s.prefix_entries = static_cast<int32_t>(p.n_experts + 1);
    // Item table: a CTA's run of at most ceil(units / ctas) units touches at most (share - 1) / K + 2 pass-tiles.
    for (const MoeW4a16MatrixInfo* m : {&info.gate_up, &info.down}) {
      for (int64_t n = 1; n <= max_active * m->n_items; ++n) {
        w4::Plan pl;
        w4::set_stream_units(pl, static_cast<int>(n), m->n_kstages, grid);
        const int64_t share = (pl.units + pl.ctas - 1) / pl.ctas;
        const int64_t entries = std::min<int64_t>(n, (share - 1) / m->n_kstages + 2);
        s.table_entries = std::max(s.table_entries, static_cast<int32_t>(entries));
      }
    }
    return s;
  }
  if (p.n_tokens <= w4::kChunkRows) {
    // Parallel splits: the most slots any number of touched experts can ask for, by the kernel's own rule.
    for (const MoeW4a16MatrixInfo* m : {&info.gate_up, &info.down}) {
      for (int64_t n = 1; n <= max_active; ++n) {
        const int splits = w4::choose_splits(n * m->n_items, m->n_kstages, grid, p.fixed_splits, s.nb_cap);
        if (splits > 1) s.partial_slots = std::max(s.partial_slots, splits * n * m->n_items);
      }
    }
  }
  s.seq_slot_base = s.partial_slots;
  if (p.n_tokens > w4::kChunkRows && p.fixed_splits > 1) s.partial_slots += grid;  // in-order splits: one per CTA
  // Item table: the most items CTA 0 (which has the most) takes, over every touched-expert count, by the kernel's plan.
  // Overlapped down: its tickets' shares (CTA 0's is the largest there too).
  for (const MoeW4a16MatrixInfo* m : {&info.gate_up, &info.down}) {
    const w4::ScheduleParams sp =
        w4::schedule_params(m->n_items, m->n_kstages, s.nb_cap, p.fixed_splits, p.n_tokens, false);
    for (int64_t n = 1; n <= max_active; ++n) {
      w4::Plan pl = w4::make_plan(sp, static_cast<int>(n), grid);
      if (m == &info.down && s.overlap_counters > 0) pl.head = w4::overlap_head(n * info.gate_up.n_items, grid);
      s.table_entries = std::max(s.table_entries, w4::items_of_cta(pl, 0, grid));
    }
  }
  return s;
}

std::vector<float> moe_w4a16_unpack(const MoeW4a16LayoutInfo& info, std::span<const std::byte> layout, int64_t slot,
                                    MoeW4a16Proj proj, int which) {
  BG_CHECK(static_cast<int64_t>(layout.size()) == info.total_bytes && slot >= 0 && slot < info.n_slots,
           "moe_w4a16_unpack: slot {} of {} in {} bytes (want {})", slot, info.n_slots, layout.size(),
           info.total_bytes);
  return moe_w4a16_unpack_block(
      info, layout.subspan(static_cast<size_t>(slot * info.block_bytes), static_cast<size_t>(info.block_bytes)), proj,
      which);
}

std::vector<float> moe_w4a16_unpack_block(const MoeW4a16LayoutInfo& info, std::span<const std::byte> block,
                                          MoeW4a16Proj proj, int which) {
  BG_CHECK(info.version == kMoeW4a16LayoutVersion, "moe_w4a16_unpack: layout version {} (this build reads {})",
           info.version, kMoeW4a16LayoutVersion);
  BG_CHECK(static_cast<int64_t>(block.size()) == info.block_bytes, "moe_w4a16_unpack: block of {} bytes (want {})",
           block.size(), info.block_bytes);
  const MoeW4a16MatrixInfo& m = proj == MoeW4a16Proj::kGateUp ? info.gate_up : info.down;
  const float shift = std::ldexp(1.0f, m.scale_shift);
  std::vector<float> out(static_cast<size_t>(m.n_out * m.n_in), 0.0f);
  const auto* base = reinterpret_cast<const uint8_t*>(block.data()) + m.offset_bytes;
  for (int item = 0; item < m.n_items; ++item) {
    for (int kstage = 0; kstage < m.n_kstages; ++kstage) {
      const uint8_t* stage = base + (static_cast<int64_t>(item) * m.n_kstages + kstage) * w4::kStageBytes;
      for (int warp = 0; warp < w4::kWarps; ++warp) {
        for (int mt = 0; mt < w4::kMTiles; ++mt) {
          if (proj == MoeW4a16Proj::kGateUp && static_cast<int>(w4::gate_up_is_up(mt)) != which) continue;
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, t = lane & 3;
            uint32_t words[4];
            std::memcpy(words, stage + w4::code_offset(warp, mt, lane), sizeof(words));
            for (int ks = 0; ks < 4; ++ks) {
              uint32_t r[4];
              w4::decode_word(words[ks], r);
              for (int i = 0; i < 8; ++i) {
                const int rh = w4::element_row_half(i);
                const int64_t row = proj == MoeW4a16Proj::kGateUp ? w4::gate_up_column(item, warp, mt, g + 8 * rh)
                                                                  : w4::down_row(item, warp, mt, g + 8 * rh);
                const int64_t k = static_cast<int64_t>(kstage) * w4::kKStage + w4::element_k(t, ks, i);
                if (row >= m.n_out || k >= m.n_in) continue;
                // As the kernel: bf16 lane (value * 2^-126) times the bf16 scale 2^(s'-127), rounded to bf16, then the
                // fp32 accumulator's 2^shift.
                const auto lane_bits = static_cast<uint16_t>(r[i >> 1] >> (16 * (i & 1)));
                const uint8_t s_prime = stage[w4::scale_offset(warp, g, t >> 1, mt, rh)];
                const auto scale_bits = static_cast<uint16_t>(w4::scale_bf16x2(s_prime) & 0xffffu);
                const float prod = bf16_to_f32(f32_to_bf16(bf16_to_f32(lane_bits) * bf16_to_f32(scale_bits)));
                out[static_cast<size_t>(row * m.n_in + k)] = prod * shift;
              }
            }
          }
        }
      }
    }
  }
  return out;
}

void moe_w4a16_unpack_expert(const MoeW4a16LayoutInfo& info, std::span<const std::byte> block,
                             const MoeW4a16ExpertBytes& out) {
  BG_CHECK(info.version == kMoeW4a16LayoutVersion, "moe_w4a16_unpack_expert: layout version {} (this build reads {})",
           info.version, kMoeW4a16LayoutVersion);
  BG_CHECK(static_cast<int64_t>(block.size()) == info.block_bytes,
           "moe_w4a16_unpack_expert: block of {} bytes (want {})", block.size(), info.block_bytes);
  const char* names[3] = {"gate", "up", "down"};
  const MoeW4a16MatrixInfo* mats[3] = {&info.gate_up, &info.gate_up, &info.down};
  const std::span<std::byte> codes[3] = {out.gate_codes, out.up_codes, out.down_codes};
  const std::span<std::byte> scales[3] = {out.gate_scales, out.up_scales, out.down_scales};
  ExpertOut dst;
  for (int i = 0; i < 3; ++i) {
    const int64_t n_out = mats[i]->n_out, n_in = mats[i]->n_in;
    BG_CHECK(static_cast<int64_t>(codes[i].size()) == n_out * n_in / 2,
             "moe_w4a16_unpack_expert: {} codes span of {} bytes, want [{}, {}] = {}", names[i], codes[i].size(), n_out,
             n_in / 2, n_out * n_in / 2);
    BG_CHECK(static_cast<int64_t>(scales[i].size()) == n_out * (n_in / kMxfp4GroupSize),
             "moe_w4a16_unpack_expert: {} scales span of {} bytes, want [{}, {}] = {}", names[i], scales[i].size(),
             n_out, n_in / kMxfp4GroupSize, n_out * (n_in / kMxfp4GroupSize));
    dst.codes[i] = reinterpret_cast<uint8_t*>(codes[i].data());
    dst.scales[i] = reinterpret_cast<uint8_t*>(scales[i].data());
  }
  static const UnpairTable unpair = make_unpair_table();
  const auto* base = reinterpret_cast<const uint8_t*>(block.data());
  std::mutex bad_mutex;
  BadScale first_bad;  // the one of the lowest stage block, so the message does not depend on the threads' timing
  parallel_for(n_stage_blocks(info.gate_up) + n_stage_blocks(info.down), 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const StageRef st = stage_ref(info, i);
      unpack_stage_codes(base + st.offset_bytes, st, unpair, dst);
      BadScale bad = unpack_stage_scales(base + st.offset_bytes, st, dst);
      if (bad.matrix < 0) continue;
      bad.stage_idx = i;
      const std::lock_guard<std::mutex> lock(bad_mutex);
      if (first_bad.matrix < 0 || i < first_bad.stage_idx) first_bad = bad;
    }
  });
  if (first_bad.matrix < 0) return;
  const BadScale& bad = first_bad;
  const int shift = mats[bad.matrix]->scale_shift;
  BG_CHECK(bad.s_prime != 0 || shift == 0,
           "moe_w4a16_unpack_expert: {} row {} group {} has the stored scale 0 under the scale shift {}: a clamped "
           "scale (the packer stores max(0, s + 126 - shift)), not invertible", names[bad.matrix], bad.row, bad.group,
           shift);
  fail("moe_w4a16_unpack_expert: {} row {} group {} has the stored scale {} under the scale shift {} (s = {}): not "
       "a block moe_w4a16_pack_expert wrote (it stores s' <= 254 of an s in 0..254)", names[bad.matrix], bad.row,
       bad.group, bad.s_prime, shift, bad.s_prime - 126 + shift);
}

}  // namespace bg::ops
