// MLA decode attention layouts on the CPU: the kernel's own address formulas (mla_decode_layout.h) driven through
// emulations of ldmatrix (x4, .trans), mma.sync.m16n8k16 and wgmma m64nNk16 with SW128 descriptors, written from the
// PTX ISA definitions (fragment tables; canonical K-/M-major layouts with Swizzle<3,4,3> on byte addresses). The
// products must come out exactly (small dyadic inputs, exact fp32 sums) at the rows and columns the accumulator
// formulas name: the writers (cp.async chunks, P stores) and readers (ldmatrix lanes, wgmma descriptors) agree, and
// every ldmatrix phase is free of bank conflicts. What this cannot check is the hardware itself: the GPU parity test.
#include "ops/mla/mla_decode_layout.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <random>
#include <set>
#include <vector>

namespace bg::ops::mla_layout {
namespace {

constexpr int kTile = 64, kEntry = 576, kLora = 512;

// A shared-memory image: one float per bf16 slot (byte offset / 2); NaN where nothing was written.
struct Image {
  std::vector<float> v;
  explicit Image(uint32_t bytes) : v(bytes / 2, NAN) {}
  void put(uint32_t byte, float x) {
    ASSERT_EQ(byte % 2, 0u);
    ASSERT_LT(byte / 2, v.size());
    ASSERT_TRUE(std::isnan(v[byte / 2])) << "byte " << byte << " written twice";
    v[byte / 2] = x;
  }
  float at(uint32_t byte) const { return v.at(byte / 2); }
};

// Values k/4, k in [-4, 4]: products and sums of up to 576 of them are exact in fp32.
std::vector<float> dyadic(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(n);
  for (auto& e : x) e = static_cast<float>(static_cast<int>(rng() % 9) - 4) / 4.0f;
  return x;
}

// The three operand buffers of one CTA, written through the kernel's writer formulas.
struct Operands {
  int heads;
  uint32_t q_slab;
  std::vector<float> tile, q, p;  // [64][576], [heads][576], [heads][64]
  Image tile_img, q_img, p_img;

  explicit Operands(int n_heads)
      : heads(n_heads),
        q_slab(static_cast<uint32_t>(n_heads) * 128),
        tile(dyadic(kTile * kEntry, 1)),
        q(dyadic(static_cast<size_t>(n_heads) * kEntry, 2)),
        p(dyadic(static_cast<size_t>(n_heads) * kTile, 3)),
        tile_img(kTileBytes),
        q_img(9 * q_slab),
        p_img(q_slab) {
    for (uint32_t r = 0; r < kTile; ++r) {
      for (uint32_t col = 0; col < kEntry; ++col) {
        tile_img.put(chunk_offset(r, col / 8, kTileSlabBytes) + (col % 8) * 2, tile[r * kEntry + col]);
      }
    }
    for (uint32_t h = 0; h < static_cast<uint32_t>(heads); ++h) {
      for (uint32_t col = 0; col < kEntry; ++col) q_img.put(chunk_offset(h, col / 8, q_slab) + (col % 8) * 2, q[h * kEntry + col]);
      for (uint32_t pos = 0; pos < kTile; ++pos) p_img.put(p_offset(h, pos), p[h * kTile + pos]);
    }
  }
  float s_ref(int row, int head, int k_lo, int k_hi) const {  // Σ_k tile[row][k] q[head][k]
    float acc = 0.0f;
    for (int k = k_lo; k < k_hi; ++k) acc += tile[row * kEntry + k] * q[head * kEntry + k];
    return acc;
  }
  float o_ref(int channel, int head) const {  // Σ_pos tile[pos][channel] p[head][pos]
    float acc = 0.0f;
    for (int pos = 0; pos < kTile; ++pos) acc += tile[pos * kEntry + channel] * p[head * kTile + pos];
    return acc;
  }
};

// ---- PTX emulation ---------------------------------------------------------------------------------------------

using Frag = std::array<std::array<float, 2>, 4>;  // 4 registers x 2 bf16 of one lane

// ldmatrix.sync.aligned.m8n8.x4[.trans].b16: matrix i's row r is the 16 bytes at lanes[8i + r]'s address; lane l
// receives row l/4, elements 2(l%4), 2(l%4)+1 of each matrix (of its transpose with .trans).
std::array<Frag, 32> ldmatrix_x4(const Image& img, const std::array<uint32_t, 32>& addr, bool trans) {
  std::array<Frag, 32> out{};
  for (int i = 0; i < 4; ++i) {
    float m[8][8];
    std::set<uint32_t> banks;
    for (int r = 0; r < 8; ++r) {
      EXPECT_EQ(addr[8 * i + r] % 16, 0u) << "ldmatrix row address must be 16-byte aligned";
      banks.insert((addr[8 * i + r] / 16) % 8);
      for (int c = 0; c < 8; ++c) m[r][c] = img.at(addr[8 * i + r] + 2 * c);
    }
    EXPECT_EQ(banks.size(), 8u) << "matrix " << i << " of an ldmatrix has a bank conflict";
    for (int l = 0; l < 32; ++l) {
      for (int e = 0; e < 2; ++e) out[l][i][e] = trans ? m[2 * (l % 4) + e][l / 4] : m[l / 4][2 * (l % 4) + e];
    }
  }
  return out;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX fragment tables, g = lane/4, t = lane%4):
// A a0:(g, 2t..) a1:(g+8, 2t..) a2:(g, 2t+8..) a3:(g+8, 2t+8..); B b0:(k 2t.., n g) b1:(k 2t+8.., n g);
// C c0,c1:(g, 2t..) c2,c3:(g+8, 2t..).
void mma_m16n8k16(std::array<std::array<float, 4>, 32>& d, const std::array<Frag, 32>& a,
                  const std::array<Frag, 32>& b, int b_reg0) {
  float am[16][16], bm[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int e = 0; e < 2; ++e) {
      am[g][2 * t + e] = a[l][0][e];
      am[g + 8][2 * t + e] = a[l][1][e];
      am[g][2 * t + 8 + e] = a[l][2][e];
      am[g + 8][2 * t + 8 + e] = a[l][3][e];
      bm[2 * t + e][g] = b[l][b_reg0][e];
      bm[2 * t + 8 + e][g] = b[l][b_reg0 + 1][e];
    }
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
      float acc = 0.0f;
      for (int k = 0; k < 16; ++k) acc += am[row][k] * bm[k][col];
      d[l][i] += acc;
    }
  }
}

// wgmma SW128 descriptor decoding and the canonical layouts (PTX ISA 9.7.15.5.1.2): K-major element (row, k) of a
// k16 slice at start + (row/8) SBO + (row%8) 128 + 2k; M-major element (m, k) at start + (m/64) LBO + 2 (m%64) +
// (k/8) SBO + (k%8) 128; then the 128-byte swizzle XORs byte-address bits 4-6 with bits 7-9.
struct Desc {
  uint32_t start, lbo, sbo;
};
Desc decode(uint64_t d) {
  EXPECT_EQ(d >> 62, 1u) << "128-byte swizzle";
  EXPECT_EQ((d >> 49) & 7u, 0u) << "base offset";
  return {static_cast<uint32_t>(d & 0x3FFFu) << 4, static_cast<uint32_t>((d >> 16) & 0x3FFFu) << 4,
          static_cast<uint32_t>((d >> 32) & 0x3FFFu) << 4};
}
uint32_t swizzle(uint32_t addr) { return addr ^ (((addr >> 7) & 7u) << 4); }
uint32_t k_major(const Desc& d, int row, int k) { return swizzle(d.start + (row / 8) * d.sbo + (row % 8) * 128 + 2 * k); }
uint32_t m_major(const Desc& d, int m, int k) {
  return swizzle(d.start + (m / 64) * d.lbo + 2 * (m % 64) + (k / 8) * d.sbo + (k % 8) * 128);
}

// ---- the tests ------------------------------------------------------------------------------------------------

TEST(MlaDecodeLayout, WritersFillEveryByteOnce) {
  for (int heads : {16, 32, 48}) {
    const Operands ops(heads);
    for (const Image* img : {&ops.tile_img, &ops.q_img, &ops.p_img}) {
      for (float x : img->v) ASSERT_FALSE(std::isnan(x)) << "a byte no writer covers (" << heads << " heads)";
    }
  }
}

// Q·Kᵀ of both warpgroups through ldmatrix + mma.sync; the sum of their partials is the full 576-column product.
void check_qk_mma_sync(int heads) {
  const Operands ops(heads);
  const int n_tiles = heads / 8;
  for (int wg = 0; wg < 2; ++wg) {
    for (int w = 0; w < 4; ++w) {
      std::vector<std::array<std::array<float, 4>, 32>> s(static_cast<size_t>(n_tiles));
      for (int kk = kKStepsPerWg * wg; kk < kKStepsPerWg * (wg + 1); ++kk) {
        std::array<uint32_t, 32> a_addr{};
        for (int l = 0; l < 32; ++l) a_addr[l] = qk_a_lane(l, w, kk);
        const auto a = ldmatrix_x4(ops.tile_img, a_addr, false);
        for (int jp = 0; jp < n_tiles / 2; ++jp) {
          std::array<uint32_t, 32> b_addr{};
          for (int l = 0; l < 32; ++l) b_addr[l] = qk_b_lane(l, jp, kk, ops.q_slab);
          const auto b = ldmatrix_x4(ops.q_img, b_addr, false);
          mma_m16n8k16(s[2 * jp], a, b, 0);
          mma_m16n8k16(s[2 * jp + 1], a, b, 2);
        }
      }
      for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < n_tiles * 4; ++i) {
          const int row = acc_row(l, w, i), col = acc_col(l, i);
          ASSERT_EQ(s[i / 4][l][i % 4], ops.s_ref(row, col, 288 * wg, 288 * (wg + 1)))
              << heads << " heads, warpgroup " << wg << " warp " << w << " lane " << l << " element " << i;
        }
      }
    }
  }
}

TEST(MlaDecodeLayout, QkMmaSyncFragmentsMatchTheProduct) {
  for (int heads : {16, 32, 48}) check_qk_mma_sync(heads);
}

void check_pv_mma_sync(int heads) {
  const Operands ops(heads);
  const int n_tiles = heads / 8;
  for (int wg = 0; wg < 2; ++wg) {
    for (int w = 0; w < 4; ++w) {
      for (int c = 0; c < 4; ++c) {
        std::vector<std::array<std::array<float, 4>, 32>> o(static_cast<size_t>(n_tiles));
        for (int ks = 0; ks < kTile / 16; ++ks) {
          std::array<uint32_t, 32> a_addr{};
          for (int l = 0; l < 32; ++l) a_addr[l] = pv_a_lane(l, w, wg, c, ks);
          const auto a = ldmatrix_x4(ops.tile_img, a_addr, true);
          for (int jp = 0; jp < n_tiles / 2; ++jp) {
            std::array<uint32_t, 32> b_addr{};
            for (int l = 0; l < 32; ++l) b_addr[l] = pv_b_lane(l, jp, ks);
            const auto b = ldmatrix_x4(ops.p_img, b_addr, false);
            mma_m16n8k16(o[2 * jp], a, b, 0);
            mma_m16n8k16(o[2 * jp + 1], a, b, 2);
          }
        }
        for (int l = 0; l < 32; ++l) {
          for (int i = 0; i < n_tiles * 4; ++i) {
            const int ch = pv_channel(wg, c, acc_row(l, w, i)), head = acc_col(l, i);
            ASSERT_LT(ch, kLora);
            ASSERT_EQ(o[i / 4][l][i % 4], ops.o_ref(ch, head))
                << heads << " heads, warpgroup " << wg << " warp " << w << " chunk " << c << " lane " << l;
          }
        }
      }
    }
  }
}

TEST(MlaDecodeLayout, PvMmaSyncFragmentsMatchTheProduct) {
  for (int heads : {16, 32, 48}) check_pv_mma_sync(heads);
}

// wgmma: D[64, heads] over the warpgroup's descriptors, read back through the accumulator formulas of all 4 warps.
TEST(MlaDecodeLayout, WgmmaDescriptorsAddressTheOperands) {
  for (int heads : {16, 32, 48}) {
    const Operands ops(heads);
    for (int wg = 0; wg < 2; ++wg) {
      std::vector<float> d(static_cast<size_t>(64 * heads), 0.0f);  // Q·Kᵀ: [64 positions, heads]
      for (int kk = kKStepsPerWg * wg; kk < kKStepsPerWg * (wg + 1); ++kk) {
        const Desc a = decode(sw128_desc(qk_a_start(kk), kKMajorLbo, kKMajorSbo));
        const Desc b = decode(sw128_desc(qk_b_start(kk, ops.q_slab), kKMajorLbo, kKMajorSbo));
        for (int m = 0; m < 64; ++m) {
          for (int n = 0; n < heads; ++n) {
            for (int k = 0; k < 16; ++k) d[m * heads + n] += ops.tile_img.at(k_major(a, m, k)) * ops.q_img.at(k_major(b, n, k));
          }
        }
      }
      for (int w = 0; w < 4; ++w) {
        for (int l = 0; l < 32; ++l) {
          for (int i = 0; i < heads / 2; ++i) {
            const int row = acc_row(l, w, i), col = acc_col(l, i);
            ASSERT_EQ(d[row * heads + col], ops.s_ref(row, col, 288 * wg, 288 * (wg + 1))) << "Q·Kᵀ, " << heads;
          }
        }
      }
      for (int c = 0; c < 4; ++c) {
        std::vector<float> o(static_cast<size_t>(64 * heads), 0.0f);  // P·V chunk: [64 channels, heads]
        for (int ks = 0; ks < kTile / 16; ++ks) {
          const Desc a = decode(sw128_desc(pv_a_start(wg, c, ks), kMMajorLbo, kMMajorSbo));
          const Desc b = decode(sw128_desc(pv_b_start(ks), kKMajorLbo, kKMajorSbo));
          for (int m = 0; m < 64; ++m) {
            for (int n = 0; n < heads; ++n) {
              for (int k = 0; k < 16; ++k) o[m * heads + n] += ops.tile_img.at(m_major(a, m, k)) * ops.p_img.at(k_major(b, n, k));
            }
          }
        }
        for (int w = 0; w < 4; ++w) {
          for (int l = 0; l < 32; ++l) {
            for (int i = 0; i < heads / 2; ++i) {
              const int row = acc_row(l, w, i), col = acc_col(l, i);
              ASSERT_EQ(o[row * heads + col], ops.o_ref(pv_channel(wg, c, row), col)) << "P·V, " << heads;
            }
          }
        }
      }
    }
  }
}

TEST(MlaDecodeLayout, TileLoaderDestinationsAreTheChunkOffsets) {
  for (uint32_t rows : {32u, 64u}) {
    const uint32_t per_row = 256 / rows;
    std::set<uint32_t> seen;
    for (uint32_t row = 0; row < rows; ++row) {
      for (uint32_t part = 0; part < per_row; ++part) {
        for (uint32_t i = 0; i < 72 / per_row; ++i) {
          const uint32_t d = load_rows_dst(rows, row, part, i);
          ASSERT_EQ(d, chunk_offset(row, part + per_row * i, rows * 128)) << rows << " rows, row " << row;
          ASSERT_TRUE(seen.insert(d).second);
        }
      }
    }
    EXPECT_EQ(seen.size(), rows * 72u);  // every 16-byte chunk of the tile once
  }
}

// Heads as M: Q·Kᵀ with Q as the m64 A operand (rows past the group's heads are never checked: they read the next
// slab or the pad) and a 32-position half tile as B; each warpgroup's k-steps give its partial.
TEST(MlaDecodeLayout, HeadsMQkDescriptorsAddressTheOperands) {
  constexpr int kHalf = static_cast<int>(kHalfTile);
  const std::vector<float> half = dyadic(kHalf * kEntry, 4);
  Image half_img(kHalfTileBytes);
  for (uint32_t r = 0; r < kHalfTile; ++r) {
    for (uint32_t col = 0; col < kEntry; ++col) {
      half_img.put(chunk_offset(r, col / 8, kHalfSlabBytes) + (col % 8) * 2, half[r * kEntry + col]);
    }
  }
  for (int heads : {16, 32, 48}) {
    const Operands ops(heads);
    Image q_img(9 * ops.q_slab + static_cast<uint32_t>(64 - heads) * 128);
    for (uint32_t h = 0; h < static_cast<uint32_t>(heads); ++h) {
      for (uint32_t col = 0; col < kEntry; ++col) {
        q_img.put(chunk_offset(h, col / 8, ops.q_slab) + (col % 8) * 2, ops.q[h * kEntry + col]);
      }
    }
    for (int wg = 0; wg < 2; ++wg) {
      std::vector<float> d(static_cast<size_t>(64 * kHalf), 0.0f);
      for (int kk = kKStepsPerWg * wg; kk < kKStepsPerWg * (wg + 1); ++kk) {
        const Desc a = decode(sw128_desc(hm_qk_a_start(kk, ops.q_slab), kKMajorLbo, kKMajorSbo));
        const Desc b = decode(sw128_desc(hm_qk_b_start(kk), kKMajorLbo, kKMajorSbo));
        for (int m = 0; m < heads; ++m) {
          for (int n = 0; n < kHalf; ++n) {
            for (int k = 0; k < 16; ++k) d[m * kHalf + n] += q_img.at(k_major(a, m, k)) * half_img.at(k_major(b, n, k));
          }
        }
      }
      for (int m = 0; m < heads; ++m) {
        for (int n = 0; n < kHalf; ++n) {
          float ref = 0.0f;
          for (int k = 288 * wg; k < 288 * (wg + 1); ++k) ref += ops.q[m * kEntry + k] * half[n * kEntry + k];
          ASSERT_EQ(d[m * kHalf + n], ref) << heads << " heads, warpgroup " << wg << ", head " << m << " pos " << n;
        }
      }
      // The rows past the heads stay inside the Q buffer and its pad.
      const Desc last = decode(sw128_desc(hm_qk_a_start(kKStepsPerWg * 2 - 1, ops.q_slab), kKMajorLbo, kKMajorSbo));
      EXPECT_LT(k_major(last, 63, 15), q_img.v.size() * 2) << heads << " heads";
    }
  }
}

// Heads as M, P·V: the A registers repacked from the S accumulators (hm_p_src) hold P in mma.m16n8k16's A layout,
// and the MN-major descriptors read V = the half tile's channels for each warpgroup's channel blocks.
TEST(MlaDecodeLayout, HeadsMPvOperandsFromAccumulatorsAndHalfTile) {
  constexpr int kHalf = static_cast<int>(kHalfTile);
  const std::vector<float> p = dyadic(64 * kHalf, 5), half = dyadic(kHalf * kEntry, 6);
  Image half_img(kHalfTileBytes);
  for (uint32_t r = 0; r < kHalfTile; ++r) {
    for (uint32_t col = 0; col < kEntry; ++col) {
      half_img.put(chunk_offset(r, col / 8, kHalfSlabBytes) + (col % 8) * 2, half[r * kEntry + col]);
    }
  }
  for (int w = 0; w < 4; ++w) {
    for (int l = 0; l < 32; ++l) {
      float acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = p[acc_row(l, w, i) * kHalf + acc_col(l, i)];
      const int g = l / 4, t = l % 4;
      for (int kk = 0; kk < 2; ++kk) {
        for (int reg = 0; reg < 4; ++reg) {
          const int row = 16 * w + g + 8 * (reg % 2), col = 16 * kk + 2 * t + 8 * (reg / 2);
          for (int e = 0; e < 2; ++e) {
            ASSERT_EQ(acc[hm_p_src(kk, reg) + e], p[row * kHalf + col + e]) << "warp " << w << " lane " << l;
          }
        }
      }
    }
  }
  for (int wg = 0; wg < 2; ++wg) {
    for (int cb = 0; cb < 4; ++cb) {
      for (int kk = 0; kk < 2; ++kk) {
        const Desc b = decode(sw128_desc(hm_pv_b_start(wg, cb, kk), kHmPvLbo, kHmPvSbo));
        for (int n = 0; n < 64; ++n) {
          for (int k = 0; k < 16; ++k) {
            ASSERT_EQ(half_img.at(m_major(b, n, k)), half[(16 * kk + k) * kEntry + 256 * wg + 64 * cb + n])
                << "warpgroup " << wg << " block " << cb << " k-step " << kk;
          }
        }
      }
    }
  }
}

TEST(MlaDecodeLayout, AccumulatorFormulasCoverEachElementOnce) {
  // 128 threads x (N/2) elements name every (row, column) of the 64 x N warpgroup tile exactly once.
  for (int n : {16, 32, 48}) {
    std::set<std::pair<int, int>> seen;
    for (int w = 0; w < 4; ++w) {
      for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < n / 2; ++i) ASSERT_TRUE(seen.insert({acc_row(l, w, i), acc_col(l, i)}).second);
      }
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(64 * n));
  }
}

}  // namespace
}  // namespace bg::ops::mla_layout
