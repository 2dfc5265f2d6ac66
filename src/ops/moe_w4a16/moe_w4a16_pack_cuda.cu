// One expert's W4A16 block packed on the device from its checkpoint-format copy (moe_w4a16_cuda.h,
// moe_w4a16_pack_cuda): the bytes the host builder writes (moe_w4a16_layout.cpp, pack_block), for a streamed expert
// whose pool buffer received the checkpoint's bytes. One thread per (stage block, warp, tile, lane): the lane's 16 code
// bytes (rows g and g + 8, inputs 16 t .. 16 t + 15 of the stage) and one of the stage's 1024 scale bytes.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops {
namespace {

using namespace w4;

constexpr int kPackThreads = 256;
constexpr int kLaneTiles = kWarps * kMTiles * 32;  // per stage block

// The checkpoint-format bytes of the expert's three matrices: E2M1 codes [n_out, n_in / 2] (low nibble = even input)
// and E8M0 scales [n_out, n_in / 32]; index 0 gate, 1 up, 2 down.
struct PackSource {
  const uint8_t* codes[3];
  const uint8_t* scales[3];
};

// codes[i] / scales[i] by selects: a kernel parameter array indexed at run time is copied to local memory.
__device__ __forceinline__ const uint8_t* pick(const uint8_t* const (&p)[3], int i) {
  return i == 0 ? p[0] : (i == 1 ? p[1] : p[2]);
}

// Position in the stored word of code bit b of element i (w4::source_bit), as a table the device can index.
struct SourceBits {
  int8_t bit[8][4];
};
constexpr SourceBits make_source_bits() {
  SourceBits s{};
  for (int i = 0; i < 8; ++i) {
    for (int b = 0; b < 4; ++b) s.bit[i][b] = static_cast<int8_t>(source_bit(i, b));
  }
  return s;
}
__constant__ SourceBits kSourceBits = make_source_bits();

// The stored-word bits of one code byte (inputs 2p and 2p + 1 of a row half) at element pair p (the host's PairTable).
__device__ __forceinline__ uint32_t encode_pair(int p, uint32_t byte) {
  uint32_t w = 0;
  for (int h = 0; h < 2; ++h) {
    for (int b = 0; b < 4; ++b) w |= ((byte >> (4 * h + b)) & 1u) << kSourceBits.bit[2 * p + h][b];
  }
  return w;
}

// Which matrix and row tile row r16 of (item, warp, tile mt) holds; row < 0 past the real rows (padding).
__device__ __forceinline__ void tile_row(bool gate_up, const MoeW4a16MatrixInfo& m, int item, int warp, int mt, int r16,
                                         int& matrix, int64_t& row) {
  matrix = gate_up ? (gate_up_is_up(mt) ? 1 : 0) : 2;
  row = gate_up ? gate_up_column(item, warp, mt, r16) : down_row(item, warp, mt, r16);
  if (row >= m.n_out) row = -1;
}

__global__ void __launch_bounds__(kPackThreads) pack_kernel(MoeW4a16LayoutInfo info, PackSource src, uint8_t* block,
                                                            int32_t* error_flags) {
  // The byte-pair table of the host builder: 4 lookups per stored word instead of 32 bit moves.
  __shared__ uint32_t pairs[4][256];
  for (int e = static_cast<int>(threadIdx.x); e < 4 * 256; e += kPackThreads) {
    pairs[e >> 8][e & 255] = encode_pair(e >> 8, static_cast<uint32_t>(e & 255));
  }
  __syncthreads();
  const int64_t gu_stages = static_cast<int64_t>(info.gate_up.n_items) * info.gate_up.n_kstages;
  const int64_t n = (gu_stages + static_cast<int64_t>(info.down.n_items) * info.down.n_kstages) * kLaneTiles;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const auto stage = static_cast<int>(i / kLaneTiles);  // < 2^31: the stage blocks of one expert
    const int in_stage = static_cast<int>(i % kLaneTiles);
    const int lane = in_stage & 31, mt = (in_stage >> 5) % kMTiles, warp = in_stage / (32 * kMTiles);
    const bool gu = stage < gu_stages;
    const MoeW4a16MatrixInfo m = gu ? info.gate_up : info.down;  // a copy: a reference would pin the params in memory
    const int s_in = gu ? stage : stage - static_cast<int>(gu_stages);
    const int item = s_in / m.n_kstages, kstage = s_in % m.n_kstages;
    uint8_t* dst = block + m.offset_bytes + static_cast<int64_t>(s_in) * kStageBytes;
    const int g = lane >> 2, t = lane & 3;
    // Codes: 8 bytes of row g and of row g + 8 (inputs 16 t .. 16 t + 15; zeros past the real rows or inputs).
    const int64_t k0 = static_cast<int64_t>(kstage) * kKStage + 16 * t;
    uint2 lo[2] = {make_uint2(0, 0), make_uint2(0, 0)};  // [row half]: its 8 code bytes
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      int matrix = 0;
      int64_t row = 0;
      tile_row(gu, m, item, warp, mt, g + 8 * rh, matrix, row);
      if (row >= 0 && k0 < m.n_in) {
        lo[rh] = __ldg(reinterpret_cast<const uint2*>(pick(src.codes, matrix) + row * (m.n_in / 2) + k0 / 2));
      }
    }
    uint32_t words[4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {  // k-step ks: inputs 16 t + 4 ks .. + 3 = bytes 2 ks, 2 ks + 1 of each row
      const int shift = 16 * (ks & 1);
      const uint32_t a = ks < 2 ? lo[0].x : lo[0].y, b = ks < 2 ? lo[1].x : lo[1].y;
      const uint32_t a0 = (a >> shift) & 0xff, a1 = (a >> (shift + 8)) & 0xff;
      const uint32_t b0 = (b >> shift) & 0xff, b1 = (b >> (shift + 8)) & 0xff;
      words[ks] = pairs[0][a0] | pairs[1][b0] | pairs[2][a1] | pairs[3][b1];
    }
    *reinterpret_cast<uint4*>(dst + code_offset(warp, mt, lane)) = make_uint4(words[0], words[1], words[2], words[3]);
    // Scale byte (warp, g, q = t / 2, mt, rh = t % 2): s' = s + 126 - shift; 0 for padding rows.
    const int q = t >> 1, rh = t & 1;
    int matrix = 0;
    int64_t row = 0;
    tile_row(gu, m, item, warp, mt, g + 8 * rh, matrix, row);
    uint8_t stored = 0;
    if (row >= 0) {
      const int64_t groups = m.n_in / kMxfp4GroupSize, group = static_cast<int64_t>(kstage) * 2 + q;
      const int s = group < groups ? __ldg(pick(src.scales, matrix) + row * groups + group) : 0;
      if (s == 0xff || s - m.scale_shift > 128) atomicOr(error_flags, kMoeErrorBadDescriptor);
      stored = static_cast<uint8_t>(min(max(s + 126 - m.scale_shift, 0), 254));
    }
    dst[scale_offset(warp, g, q, mt, rh)] = stored;
  }
}

}  // namespace

void moe_w4a16_pack_cuda(const MoeW4a16LayoutInfo& info, const ExpertWeightsCuda& w, void* block,
                         int32_t* error_flags, cudaStream_t stream) {
  BG_CHECK(info.version == kMoeW4a16LayoutVersion, "moe_w4a16_pack_cuda: layout version {} (this build writes {})",
           info.version, kMoeW4a16LayoutVersion);
  const DeviceWeight* mats[3] = {&w.gate, &w.up, &w.down};
  const int64_t outs[3] = {info.inter, info.inter, info.hidden}, ins[3] = {info.hidden, info.hidden, info.inter};
  PackSource src{};
  for (int i = 0; i < 3; ++i) {
    const DeviceWeight& d = *mats[i];
    BG_CHECK(d.format == WeightFormat::kMxfp4 && d.n_out == outs[i] && d.n_in == ins[i] && d.data && d.scale &&
                 cuda::aligned_to(d.data, 8),
             "moe_w4a16_pack_cuda: matrix {} is [{}, {}] {} at {}; the layout packs MXFP4 [{}, {}] (8-byte aligned)",
             i, d.n_out, d.n_in, weight_format_name(d.format), d.data, outs[i], ins[i]);
    src.codes[i] = static_cast<const uint8_t*>(d.data);
    src.scales[i] = static_cast<const uint8_t*>(d.scale);
  }
  BG_CHECK(block != nullptr && cuda::aligned_to(block, 16) && error_flags != nullptr,
           "moe_w4a16_pack_cuda: block {} must be 16-byte aligned and the error word given", block);
  const int64_t stages = static_cast<int64_t>(info.gate_up.n_items) * info.gate_up.n_kstages +
                         static_cast<int64_t>(info.down.n_items) * info.down.n_kstages;
  // A few grid-stride rounds per block amortise its pair table (~8 blocks per SM on the H200).
  const int64_t blocks = std::min<int64_t>((stages * kLaneTiles + kPackThreads - 1) / kPackThreads, 132 * 8);
  // The alignment gaps after each projection (none at the DeepSeek-V3 and Kimi-K3 shapes) are zeros, as on the host.
  auto* b = static_cast<uint8_t*>(block);
  const int64_t gu_end = info.gate_up.offset_bytes + info.gate_up.slot_bytes;
  const int64_t dn_end = info.down.offset_bytes + info.down.slot_bytes;
  if (info.down.offset_bytes > gu_end) {
    BG_CUDA_CHECK(cudaMemsetAsync(b + gu_end, 0, static_cast<size_t>(info.down.offset_bytes - gu_end), stream));
  }
  if (info.block_bytes > dn_end) {
    BG_CUDA_CHECK(cudaMemsetAsync(b + dn_end, 0, static_cast<size_t>(info.block_bytes - dn_end), stream));
  }
  pack_kernel<<<static_cast<unsigned>(blocks), kPackThreads, 0, stream>>>(info, src, b, error_flags);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops
