// The W4A16 prefill kernel's maps without a GPU (moe_w4a16_prefill.h): its compacted half-item codes are the decode
// kernel's tiles, its activation copies fill each tile exactly once where wgmma (read by the PTX ISA's swizzle rule)
// expects the weights' k permutation, every CTA's walk over the tiles computes each (row, half item) of every touched
// expert exactly once with the fewest N, and a host emulation of the kernel — shared-memory images built by the
// producer's copies, A registers as the consumer decodes them, B as wgmma reads it, results through the epilogue's
// map — reproduces both projections' dot products.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "ops/moe_w4a16/moe_w4a16.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"
#include "ops/moe_w4a16/moe_w4a16_prefill.h"
#include "ops/moe_w4a16/moe_w4a16_testing.h"

namespace bg::ops {
namespace {

using namespace w4_testing;

TEST(MoeW4a16Prefill, HalfCodesAreTheDecodeKernelsTiles) {
  for (int half = 0; half < w4p::kHalves; ++half) {
    std::set<int> dst, src;
    for (int warp = 0; warp < w4::kWarps; ++warp) {
      for (int mtp = 0; mtp < w4p::kHalfMTiles; ++mtp) {
        for (int lane = 0; lane < 32; ++lane) {
          const int off = w4p::half_code_offset(warp, mtp, lane);
          ASSERT_EQ(off % 16, 0);
          const int copy = off / 16;  // the copy that writes these 16 bytes
          ASSERT_LT(copy, w4p::kCodeCopies);
          EXPECT_EQ(w4p::half_code_src(half, copy), w4::code_offset(warp, 2 * half + mtp, lane))
              << "half " << half << " warp " << warp << " tile " << mtp << " lane " << lane;
          dst.insert(off);
        }
      }
    }
    for (int c = 0; c < w4p::kCodeCopies; ++c) src.insert(w4p::half_code_src(half, c));
    EXPECT_EQ(static_cast<int>(dst.size()), w4p::kCodeCopies) << "every code copy is read once";
    EXPECT_EQ(static_cast<int>(src.size()), w4p::kCodeCopies) << "no stage byte is copied twice";
    EXPECT_LT(*src.rbegin() + 16, w4::kCodeBytes + 1);
  }
}

// Word `lane` of row n (stage inputs 2 lane, 2 lane + 1) lands where wgmma reads the hardware k that the weights'
// permutation gives those inputs, and the 32 x 128 copies fill the 16 KiB tile exactly once.
TEST(MoeW4a16Prefill, ActivationCopiesLandWhereWgmmaReadsThePermutedK) {
  std::vector<int> written(w4p::kActBytes / 4, 0);
  for (int n = 0; n < w4p::kTileRows; ++n) {
    for (int lane = 0; lane < 32; ++lane) {
      const int off = w4p::act_copy_offset(n, lane);
      ASSERT_EQ(off % 4, 0);
      ASSERT_GE(off, 0);
      ASSERT_LT(off, w4p::kActBytes);
      ++written[static_cast<size_t>(off / 4)];
    }
    for (int ks = 0; ks < 4; ++ks) {
      for (int kk = 0; kk < 16; ++kk) {
        const int t = (kk & 7) >> 1, hi = kk >> 3, e = kk & 1;
        const int input = w4::stage_k(t, ks, hi, e);
        EXPECT_EQ(wgmma_b_offset(n, ks, kk), w4p::act_copy_offset(n, input >> 1) + 2 * (input & 1))
            << "row " << n << " k-step " << ks << " k " << kk;
      }
    }
  }
  EXPECT_TRUE(std::all_of(written.begin(), written.end(), [](int c) { return c == 1; }));
}

// The permuted activation layout: permuted_col is a bijection within each 64-input stage (unpermuted_col its
// inverse), keeps input pairs together, moves column c + 8 to permuted_col(c) + 32 (the gate/up epilogue relies on
// it), and its 16-byte chunk j is what act_sw128_offset puts in chunk slot j: copying chunk j of a permuted row to
// act_chunk_offset(row, j) places every input where the 4-byte copy map (act_copy_offset) does.
TEST(MoeW4a16Prefill, PermutedRowsCopyByChunkToTheSwizzledTile) {
  std::set<int> seen;
  for (int c = 0; c < 192; ++c) {
    const int pc = w4p::permuted_col(c);
    EXPECT_EQ(pc / 64, c / 64);
    EXPECT_EQ(w4p::unpermuted_col(pc), c);
    EXPECT_TRUE(seen.insert(pc).second);
    if (c % 2 == 0) {
      EXPECT_EQ(w4p::permuted_col(c + 1), pc + 1);
    }
    if (c % 16 < 8) {
      EXPECT_EQ(w4p::permuted_col(c + 8), pc + 32) << c;
    }
  }
  for (int row = 0; row < w4p::kTileRows; ++row) {
    for (int word = 0; word < 32; ++word) {
      const int pc = w4p::permuted_col(2 * word);
      EXPECT_EQ(w4p::act_copy_offset(row, word), w4p::act_chunk_offset(row, pc / 8) + 2 * (pc % 8))
          << "row " << row << " word " << word;
    }
  }
  EXPECT_EQ(w4p::permuted_width(1), 64);
  EXPECT_EQ(w4p::permuted_width(64), 64);
  EXPECT_EQ(w4p::permuted_width(96), 128);
}

// The rows a warp copies: its data rows, then zeros up to the tile's N; N the fewest of 32 / 64 / 128 covering it.
TEST(MoeW4a16Prefill, WarpsCopyTheRowsTheTilesNReads) {
  for (int rows = 1; rows <= w4p::kTileRows; ++rows) {
    const int n = w4p::tile_n(rows);
    EXPECT_GE(n, rows);
    EXPECT_TRUE(n == 32 || n == 64 || n == 128);
    if (n > 32) {
      EXPECT_GT(rows, n / 2) << "a smaller N would cover " << rows << " rows";
    }
    int data = 0, copied = 0;
    for (int warp = 0; warp < w4::kWarps; ++warp) {
      const int d = w4p::warp_data_rows(rows, warp), c = w4p::warp_copy_rows(rows, warp);
      EXPECT_LE(d, c);
      if (d < w4p::kRowsPerWarp && warp + 1 < w4::kWarps) {
        EXPECT_EQ(w4p::warp_data_rows(rows, warp + 1), 0);
      }
      data += d;
      copied += c;
    }
    EXPECT_EQ(data, rows);
    EXPECT_EQ(copied, n);
  }
}

// The ring, simulated by the rules the kernel follows (moe_w4a16_prefill.h, "The ring"): the stage read from a buffer
// is the last one issued into it and has landed, and no buffer is refilled before the last wgmma group reading it is
// done. wgmma groups: four per stage (one per k-step), each k-step then waits until at most one group is pending.
TEST(MoeW4a16Prefill, RingRefillsOnlyFinishedBuffers) {
  constexpr int kN = 60;  // stages of a CTA
  std::vector<int> holds(w4p::kStages, -1);        // the stage last issued into each buffer
  std::vector<int> read_by(w4p::kStages, -1);      // the stage last read from each buffer
  std::vector<int> stage_group;                    // cp.async group of each issued stage
  int committed = 0;                               // cp.async groups
  for (int i = 0; i < w4p::kLoadAhead; ++i) {      // prologue
    holds[static_cast<size_t>(i)] = i;
    stage_group.push_back(committed++);
  }
  int wgmma_done = -1;  // the last wgmma group known complete (groups numbered 4 s + ks)
  for (int s = 0; s < kN; ++s) {
    const int buf = s % w4p::kStages;
    // cp.async.wait_group(kCpAsyncPending): every group but the newest kCpAsyncPending is complete.
    const int landed = committed - 1 - w4p::kCpAsyncPending;
    ASSERT_EQ(holds[static_cast<size_t>(buf)], s) << "stage " << s << " reads a buffer holding another stage";
    ASSERT_LE(stage_group[static_cast<size_t>(s)], landed) << "stage " << s << " may not have landed";
    // After the barrier: refill.
    const int rb = w4p::refill_buffer(buf), next = s + w4p::kLoadAhead;
    ASSERT_EQ(rb, next % w4p::kStages) << "stage " << next << " goes where it will be read";
    if (read_by[static_cast<size_t>(rb)] >= 0) {
      ASSERT_LE(4 * read_by[static_cast<size_t>(rb)] + 3, wgmma_done)
          << "buffer " << rb << " refilled at stage " << s << " while stage " << read_by[static_cast<size_t>(rb)]
          << "'s last wgmma group may still read it";
    }
    holds[static_cast<size_t>(rb)] = next;
    stage_group.push_back(committed++);
    read_by[static_cast<size_t>(buf)] = s;
    for (int ks = 0; ks < 4; ++ks) wgmma_done = std::max(wgmma_done, 4 * s + ks - 1);  // commit, wait_group 1
  }
}

// Every CTA's tiles (b, b + grid, ...) over random routings (empty experts, one expert, many) and band widths: each
// (touched expert row, half item) exactly once, experts' tiles contiguous, bands of `band` token tiles in order, each
// half-item major.
TEST(MoeW4a16Prefill, TilesCoverEveryRowAndHalfItemOnce) {
  std::mt19937 rng(7);
  for (int round = 0; round < 40; ++round) {
    const int n_active = round == 0 ? 1 : 1 + static_cast<int>(rng() % 200);
    const int halves = 2 * (1 + static_cast<int>(rng() % 12));
    std::vector<int> rows(static_cast<size_t>(n_active));
    for (int& r : rows) r = rng() % 5 == 0 ? 0 : 1 + static_cast<int>(rng() % (round % 3 == 0 ? 40 : 700));
    std::vector<int32_t> prefix(1, 0);
    for (int r : rows) prefix.push_back(prefix.back() + w4p::token_tiles(r));
    const int total = w4p::total_tiles(prefix.data(), n_active, halves);
    std::vector<std::vector<int>> hits(static_cast<size_t>(n_active));
    for (int j = 0; j < n_active; ++j) hits[static_cast<size_t>(j)].assign(static_cast<size_t>(rows[j] * halves), 0);
    for (const auto& [grid, band] : {std::pair{1, 1}, {1, 3}, {1, 8}, {1, 1 << 20}, {7, 2}, {132, 8}, {132, 1 << 20}}) {
      for (auto& h : hits) std::fill(h.begin(), h.end(), 0);
      int last_j = -1, last_band = -1, last_hm = -1;
      for (int b = 0; b < grid; ++b) {
        for (int t = b; t < total; t += grid) {
          const w4p::TilePos p = w4p::tile_pos(prefix.data(), n_active, halves, band, t);
          ASSERT_GE(p.j, 0);
          ASSERT_LT(p.j, n_active);
          const int r = rows[static_cast<size_t>(p.j)];
          ASSERT_GT(r, 0) << "an expert without rows got tile " << t;
          ASSERT_LT(p.hm, halves);
          ASSERT_LT(p.tt, w4p::token_tiles(r));
          if (grid == 1) {  // in tile order: experts ascending, then bands, then half items within a band
            const int this_band = p.tt / band;
            if (p.j == last_j) {
              EXPECT_GE(this_band, last_band);
              if (this_band == last_band) {
                EXPECT_GE(p.hm, last_hm);
              }
            }
            EXPECT_GE(p.j, last_j);
            last_j = p.j;
            last_band = this_band;
            last_hm = p.hm;
          }
          const int lo = p.tt * w4p::kTileRows, hi = std::min(r, lo + w4p::kTileRows);
          auto& h = hits[static_cast<size_t>(p.j)];
          for (int row = lo; row < hi; ++row) ++h[static_cast<size_t>(row * halves + p.hm)];
        }
      }
      for (int j = 0; j < n_active; ++j) {
        const auto& h = hits[static_cast<size_t>(j)];
        ASSERT_TRUE(std::all_of(h.begin(), h.end(), [](int c) { return c == 1; }))
            << "round " << round << " grid " << grid << " band " << band << " expert " << j << " rows "
            << rows[static_cast<size_t>(j)];
      }
    }
  }
}

// The kernel on one expert of `n_rows` rows, emulated: each tile (half item x 128 rows) of the projection, every
// k-stage with its buffer built by the producer's copies (codes of the half, all scales, the activation rows below
// the tile's N, zeros past the data and past n_in), the A registers of both tiles of each warp's pair as stage_mma
// makes them, B read from the swizzled tile as wgmma reads it (per n8 block), and the results through the epilogue's
// map. Returns [output row][row]; gate/up: gate rows 0..inter-1, then up.
std::vector<double> emulate_prefill(const Layer& l, MoeW4a16Proj proj, const std::vector<float>& x, int n_rows) {
  const MoeW4a16MatrixInfo& m = proj == MoeW4a16Proj::kGateUp ? l.info.gate_up : l.info.down;
  const bool gu = proj == MoeW4a16Proj::kGateUp;
  std::vector<double> out(static_cast<size_t>((gu ? 2 : 1) * m.n_out * n_rows), 0.0);
  const auto* layout = reinterpret_cast<const uint8_t*>(l.bytes.data()) + m.offset_bytes;
  const int halves = static_cast<int>(w4p::kHalves * m.n_items);
  for (int hm = 0; hm < halves; ++hm) {
    const int item = hm >> 1, half = hm & 1;
    for (int tt = 0; tt < w4p::token_tiles(n_rows); ++tt) {
      const int tile_rows = std::min(n_rows - tt * w4p::kTileRows, w4p::kTileRows), n = w4p::tile_n(tile_rows);
      std::vector<double> d(static_cast<size_t>(w4::kWarps * 2 * 16 * n), 0.0);  // [warp][tile][r16][row]
      for (int kstage = 0; kstage < m.n_kstages; ++kstage) {
        const uint8_t* block = layout + (static_cast<int64_t>(item) * m.n_kstages + kstage) * w4::kStageBytes;
        std::vector<uint8_t> buf(w4p::kBufBytes, 0xEE);
        for (int c = 0; c < w4p::kCodeCopies; ++c) {
          std::memcpy(buf.data() + w4p::kBufCodes + 16 * c, block + w4p::half_code_src(half, c), 16);
        }
        for (int c = 0; c < w4p::kScaleCopies; ++c) {
          std::memcpy(buf.data() + w4p::kBufScales + 16 * c, block + w4::kCodeBytes + 16 * c, 16);
        }
        for (int warp = 0; warp < w4::kWarps; ++warp) {
          for (int i = 0; i < w4p::warp_copy_rows(tile_rows, warp); ++i) {
            const int row = warp * w4p::kRowsPerWarp + i;
            for (int lane = 0; lane < 32; ++lane) {
              uint16_t bits[2] = {0, 0};
              for (int e = 0; e < 2; ++e) {
                const int64_t k = kstage * 64 + 2 * lane + e;
                if (i < w4p::warp_data_rows(tile_rows, warp) && k < m.n_in) {
                  bits[e] = f32_to_bf16(x[static_cast<size_t>((tt * w4p::kTileRows + row) * m.n_in + k)]);
                }
              }
              std::memcpy(buf.data() + w4p::act_copy_offset(row, lane), bits, 4);
            }
          }
        }
        for (int warp = 0; warp < w4::kWarps; ++warp) {
          for (int mtp = 0; mtp < 2; ++mtp) {
            for (int ks = 0; ks < 4; ++ks) {
              uint32_t a_regs[32][4];
              for (int lane = 0; lane < 32; ++lane) {
                const int g = lane >> 2, t = lane & 3;
                uint32_t words[4], sc[2];
                std::memcpy(words, buf.data() + w4p::kBufCodes + w4p::half_code_offset(warp, mtp, lane), 16);
                std::memcpy(sc, buf.data() + w4p::kBufScales + w4::scale_offset(warp, g, t >> 1, 0, 0) -
                                    w4::kCodeBytes, 8);
                a_fragment(words, sc, 2 * half + mtp, ks, a_regs[lane]);
              }
              for (int nb = 0; nb < n / 8; ++nb) {
                uint32_t b_regs[32][2];
                for (int lane = 0; lane < 32; ++lane) {
                  const int g = lane >> 2, t = lane & 3;
                  for (int j = 0; j < 2; ++j) {
                    std::memcpy(&b_regs[lane][j], buf.data() + wgmma_b_offset(nb * 8 + g, ks, 2 * t + 8 * j), 4);
                  }
                }
                double dd[16][8] = {};
                emulate_mma(a_regs, b_regs, dd);
                for (int r = 0; r < 16; ++r)
                  for (int c = 0; c < 8; ++c)
                    d[static_cast<size_t>(((warp * 2 + mtp) * 16 + r) * n + nb * 8 + c)] += dd[r][c];
              }
            }
          }
        }
      }
      for (int warp = 0; warp < w4::kWarps; ++warp) {
        for (int mtp = 0; mtp < 2; ++mtp) {
          for (int lane = 0; lane < 32; ++lane) {
            for (int nb = 0; nb < n / 8; ++nb) {
              for (int i = 0; i < 4; ++i) {  // the epilogue's map of accumulator i of block nb
                const int tok = w4p::result_token(lane, nb, i), r16 = w4p::result_r16(lane, i);
                if (tok >= tile_rows) continue;
                const int64_t col = gu ? w4p::gate_up_column(item, half, warp, r16)
                                       : w4p::down_column(item, half, warp, mtp, r16);
                if (col >= m.n_out) continue;
                const int64_t out_row = gu && mtp == 1 ? m.n_out + col : col;
                const double v = d[static_cast<size_t>(((warp * 2 + mtp) * 16 + r16) * n + tok)];
                out[static_cast<size_t>(out_row * n_rows + tt * w4p::kTileRows + tok)] =
                    v * std::ldexp(1.0, m.scale_shift);
              }
            }
          }
        }
      }
    }
  }
  return out;
}

TEST(MoeW4a16Prefill, EmulatedKernelComputesBothProjections) {
  // hidden 576 / inter 288: two items per projection (the second partial), partial k-stages (576 = 9 x 64, 288 =
  // 4.5 x 64); 150 rows: a tile of N = 128, then 22 rows on N = 32.
  const int64_t hidden = 576, inter = 288;
  const int n_rows = 150;
  const Layer l = make_layer(1, hidden, inter, 31, 131, 118);  // gate scale shift 3
  ASSERT_EQ(l.info.gate_up.scale_shift, 3);
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (MoeW4a16Proj proj : {MoeW4a16Proj::kGateUp, MoeW4a16Proj::kDown}) {
    const bool gu = proj == MoeW4a16Proj::kGateUp;
    const int64_t n_in = gu ? hidden : inter, n_out = gu ? inter : hidden;
    std::vector<float> x(static_cast<size_t>(n_rows * n_in));
    for (auto& v : x) v = bf16_to_f32(f32_to_bf16(uni(rng)));
    const std::vector<double> got = emulate_prefill(l, proj, x, n_rows);
    std::vector<std::vector<float>> mats;
    if (gu) {
      mats = {l.gate[0].w.decode_all(), l.up[0].w.decode_all()};
    } else {
      mats = {l.down[0].w.decode_all()};
    }
    for (size_t mi = 0; mi < mats.size(); ++mi) {
      for (int64_t row = 0; row < n_out; ++row) {
        for (int tok = 0; tok < n_rows; ++tok) {
          double want = 0.0;
          for (int64_t k = 0; k < n_in; ++k) {
            want += static_cast<double>(mats[mi][static_cast<size_t>(row * n_in + k)]) *
                    x[static_cast<size_t>(tok * n_in + k)];
          }
          const double g = got[static_cast<size_t>((static_cast<int64_t>(mi) * n_out + row) * n_rows + tok)];
          ASSERT_NEAR(g, want, 1e-9 * (1.0 + std::fabs(want)))
              << (gu ? (mi ? "up" : "gate") : "down") << " output " << row << " row " << tok;
        }
      }
    }
  }
}

}  // namespace
}  // namespace bg::ops
