// Host helpers of the W4A16 layout tests (moe_w4a16_test.cpp, moe_w4a16_prefill_test.cpp): random MXFP4 experts
// packed into the layout, and the tensor-core operations emulated from the PTX ISA's fragment and shared-memory rules
// (written from the ISA, not from the layout's own maps, so that an emulation over a kernel's shared-memory images
// checks the kernel's placement).
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/moe_w4a16/moe_w4a16.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops::w4_testing {

struct Mxfp4 {
  HostTensor codes, scales;
  QuantWeight w;
};

// Random codes (all 16 values) and E8M0 scales in [base, base + 4]; `s_max` forces one group's scale.
inline Mxfp4 random_mxfp4(int64_t n_out, int64_t n_in, uint32_t seed, int base = 118, int s_max = -1) {
  Mxfp4 m;
  m.codes = HostTensor(DType::kU8, {n_out, n_in / 2});
  m.scales = HostTensor(DType::kU8, {n_out, n_in / 32});
  std::mt19937 rng(seed);
  auto* c = reinterpret_cast<uint8_t*>(m.codes.data());
  for (int64_t i = 0; i < n_out * n_in / 2; ++i) c[i] = static_cast<uint8_t>(rng());
  auto* s = reinterpret_cast<uint8_t*>(m.scales.data());
  for (int64_t i = 0; i < n_out * n_in / 32; ++i) s[i] = static_cast<uint8_t>(base + static_cast<int>(rng() % 5));
  if (s_max >= 0) s[n_out * n_in / 32 / 2] = static_cast<uint8_t>(s_max);
  m.w.format = WeightFormat::kMxfp4;
  m.w.n_out = n_out;
  m.w.n_in = n_in;
  m.w.data = m.codes.view("codes");
  m.w.scale = m.scales.view("scales");
  m.w.name = "test";
  return m;
}

struct Layer {
  std::vector<Mxfp4> gate, up, down;
  std::vector<MoeW4a16ExpertView> views;
  std::vector<std::byte> bytes;
  MoeW4a16LayoutInfo info;
};

// Down scales start at down_base (0: exponents from 2^-127, the s = 0 edge; 118: ordinary weights).
inline Layer make_layer(int64_t n_slots, int64_t hidden, int64_t inter, uint32_t seed, int s_max = -1,
                        int down_base = 0) {
  Layer l;
  for (int64_t e = 0; e < n_slots; ++e) {
    const auto s = seed + static_cast<uint32_t>(e) * 3;
    l.gate.push_back(random_mxfp4(inter, hidden, s, 118, e == 0 ? s_max : -1));
    l.up.push_back(random_mxfp4(inter, hidden, s + 1));
    l.down.push_back(random_mxfp4(hidden, inter, s + 2, down_base));
  }
  for (int64_t e = 0; e < n_slots; ++e) {
    const auto i = static_cast<size_t>(e);
    l.views.push_back({&l.gate[i].w, &l.up[i].w, &l.down[i].w});
  }
  l.bytes.resize(static_cast<size_t>(moe_w4a16_layout_info(n_slots, hidden, inter).total_bytes));
  l.info = moe_w4a16_pack(l.views, hidden, inter, l.bytes);
  return l;
}

// ---- mma.m16n8k16 emulated from the PTX ISA fragment rules ----------------------------------------------------------
// PTX (9.7.14.5.8, .bf16): groupID = lane >> 2, tig = lane % 4. A element a_i (register i/2, half i%2): row groupID
// for i in {0,1,4,5} else groupID + 8; col tig*2 + (i & 1) (+ 8 for i >= 4). B element b_i: row tig*2 + (i & 1)
// (+ 8 for i >= 2), col groupID. C element c_i: row groupID (+ 8 for i >= 2), col tig*2 + (i & 1).
inline float bf16_lane(uint32_t reg, int half) { return bf16_to_f32(static_cast<uint16_t>(reg >> (16 * half))); }

// One mma.m16n8k16 step over a warp's fragments: d[16][8] += A B, with A and B assembled element by element from the
// lanes' registers by the PTX rules above.
inline void emulate_mma(const uint32_t (&a_regs)[32][4], const uint32_t (&b_regs)[32][2], double (&d)[16][8]) {
  float a[16][16], b[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 8; ++i) {
      const int row = g + ((i < 2 || (i >= 4 && i < 6)) ? 0 : 8), col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      a[row][col] = bf16_lane(a_regs[lane][i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) b[t * 2 + (i & 1) + (i >= 2 ? 8 : 0)][g] = bf16_lane(b_regs[lane][i / 2], i % 2);
  }
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 8; ++c)
      for (int k = 0; k < 16; ++k) d[r][c] += static_cast<double>(a[r][k]) * b[k][c];
}

// What wgmma reads as B element (k = 16 ks + kk, token n) of a K-major 128-byte-swizzle operand whose descriptor starts
// at the stage's activation base + 32 ks (PTX ISA, "Shared memory matrix layout", K-major with 128B swizzling: row n
// at n * 128 inside 1024-byte atoms of 8 rows, address bits 4-6 XORed with bits 7-9). Written from the ISA, not from
// w4::act_sw128_offset, so the emulation checks the producer's placement.
inline int wgmma_b_offset(int n, int ks, int kk) {
  const int linear = n * 128 + 32 * ks + 2 * kk;
  return (linear & ~0x70) | (((linear >> 4) & 7) ^ (n & 7)) << 4;
}

// The A registers (bf16x2) of k-step ks of tile mt as the kernels make them: the code word decoded (w4::decode_word),
// each register multiplied by its row's scale with mul.rn.bf16x2, lane by lane. `words`: the lane's 16 bytes of the
// tile; `sc`: its 8 scale bytes (w4::scale_offset(warp, g, t / 2, 0, 0)).
inline void a_fragment(const uint32_t (&words)[4], const uint32_t (&sc)[2], int mt, int ks, uint32_t (&a)[4]) {
  uint32_t r[4], s_reg[2];
  w4::decode_word(words[ks], r);
  w4::tile_scales(sc[0], sc[1], mt, s_reg[0], s_reg[1]);
  for (int j = 0; j < 4; ++j) {  // registers 0, 2: row g; 1, 3: row g + 8
    const float lo = bf16_to_f32(f32_to_bf16(bf16_lane(r[j], 0) * bf16_lane(s_reg[j & 1], 0)));
    const float hi = bf16_to_f32(f32_to_bf16(bf16_lane(r[j], 1) * bf16_lane(s_reg[j & 1], 1)));
    a[j] = static_cast<uint32_t>(f32_to_bf16(lo)) | (static_cast<uint32_t>(f32_to_bf16(hi)) << 16);
  }
}

}  // namespace bg::ops::w4_testing
