// The fused KDA decode preparation (kda_prep_decode_cuda) against the separate CUDA kernels it replaces, bit for bit
// (q, k, v, g, beta and every conv state of the pool), and against the CPU references (short conv, L2 norm, gate,
// beta) within bf16 / fp32 tolerance. K3's 96 heads x 128 and smaller / odd head dims, conv widths 4 and 2, scattered
// state slots with a padding row (-1: zero q / k / v, state untouched), inputs read as column slices of a wider
// projection buffer (row strides); K3's shape with aligned strides (the 8-byte conv path) and odd ones (the other).
// The conv states are bf16 (the CPU reference's fp32 pool starts from the same bf16-rounded values) and are compared
// exactly: they hold past inputs only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/small_ops_testing.h"
#include "ops/kda_gate/kda_gate.h"
#include "ops/kda_gate/kda_gate_cuda.h"
#include "ops/kda_gate/kda_prep_cuda.h"
#include "ops/short_conv/short_conv.h"
#include "ops/short_conv/short_conv_cuda.h"

namespace bg::testing {
namespace {

struct PrepCase {
  int64_t n_seqs, n_heads, head_dim, kernel_size;
  bool strided;  // q, k, v, g_raw and b as column slices of one [n, 4P + H + spare] buffer
  // Slot stride and row stride multiples of 4 (K3's 8-byte conv path runs; the slot stride is 4 mod 8 elements, so odd
  // slots start 8 bytes past a 16-byte boundary), else odd (the 2-byte path runs).
  bool aligned = false;
};

// Rows of the [n, width] matrix that start at column col of a [n, stride] buffer.
std::vector<float> columns(const std::vector<float>& buf, int64_t n, int64_t stride, int64_t col, int64_t width) {
  std::vector<float> out(static_cast<size_t>(n * width));
  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(buf.begin() + r * stride + col, width, out.begin() + r * width);
  }
  return out;
}

void run_case(const PrepCase& c) {
  SCOPED_TRACE(::testing::Message() << "seqs " << c.n_seqs << " heads " << c.n_heads << " K " << c.head_dim << " W "
                                    << c.kernel_size << (c.strided ? " strided" : "") << (c.aligned ? " aligned" : ""));
  const int64_t n = c.n_seqs, H = c.n_heads, K = c.head_dim, W = c.kernel_size, P = H * K;
  const int64_t part = P * (W - 1), slot_stride = 3 * part + (c.aligned ? 4 : 5), n_slots = n + 7;
  // One projection buffer: [n, stride] holding q | k | v | g_raw | b | spare columns (3, or 4 to 7 when aligned).
  const int64_t buf_stride = 4 * P + H + (c.aligned ? 4 + (4 - (4 * P + H) % 4) % 4 : 3);
  const int64_t stride = c.strided ? buf_stride : 0;
  std::vector<float> all = random_floats(static_cast<size_t>(n * buf_stride), 2.0f, 91);
  to_bf16(all);
  std::vector<std::vector<float>> x(3);
  for (int i = 0; i < 3; ++i) x[static_cast<size_t>(i)] = columns(all, n, buf_stride, i * P, P);
  const std::vector<float> g_raw = columns(all, n, buf_stride, 3 * P, P), b = columns(all, n, buf_stride, 4 * P, H);
  std::vector<std::vector<float>> w(3);
  for (int i = 0; i < 3; ++i) w[static_cast<size_t>(i)] = random_floats(static_cast<size_t>(P * W), 0.7f, 92 + i);
  const std::vector<float> a_log = random_floats(static_cast<size_t>(H + 2), 1.0f, 95);
  const std::vector<float> dt_bias = random_floats(static_cast<size_t>(P), 1.0f, 96);
  std::vector<float> pool = random_floats(static_cast<size_t>(n_slots * slot_stride), 1.5f, 97);
  const std::vector<uint16_t> pool_bits = to_bf16(pool);  // rounds pool too: the CPU reference's start
  std::vector<int32_t> slots(static_cast<size_t>(n_slots));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937(static_cast<uint32_t>(n * 31 + K)));
  slots.resize(static_cast<size_t>(n));
  if (n > 2) slots[1] = -1;

  // Device inputs: contiguous per projection, or slices of the uploaded buffer.
  const cuda::DeviceBuffer d_all = cuda::upload(to_bf16(all));
  std::vector<cuda::DeviceBuffer> d_x;
  for (int i = 0; i < 3; ++i) d_x.push_back(upload_bf16(x[static_cast<size_t>(i)]));
  std::vector<float> g_raw_c = g_raw, b_c = b;
  const cuda::DeviceBuffer d_graw = upload_bf16(g_raw_c), d_b = upload_bf16(b_c);
  std::vector<cuda::DeviceBuffer> d_w;
  for (int i = 0; i < 3; ++i) d_w.push_back(cuda::upload(w[static_cast<size_t>(i)]));
  const cuda::DeviceBuffer d_alog = cuda::upload(a_log), d_dt = cuda::upload(dt_bias), d_slots = cuda::upload(slots);
  cuda::DeviceBuffer d_pool_fused = cuda::upload(pool_bits), d_pool_sep = cuda::upload(pool_bits);
  const size_t np = static_cast<size_t>(n * P), nh = static_cast<size_t>(n * H);

  // Fused.
  ops::KdaPrepDecodeInputs in;
  for (int i = 0; i < 3; ++i) {
    in.x[i] = c.strided ? bf16_ptr(d_all) + i * P : bf16_ptr(d_x[static_cast<size_t>(i)]);
    in.x_row[i] = c.strided ? stride : P;
    in.conv_weight[i] = d_w[static_cast<size_t>(i)].as<float>();
    in.conv_state[i] = {bf16_ptr(d_pool_fused) + i * part, d_slots.as<int32_t>(), slot_stride};
  }
  in.g_raw = c.strided ? bf16_ptr(d_all) + 3 * P : bf16_ptr(d_graw);
  in.g_row = c.strided ? stride : P;
  in.b = c.strided ? bf16_ptr(d_all) + 4 * P : bf16_ptr(d_b);
  in.b_row = c.strided ? stride : H;
  in.a_log = d_alog.as<float>();
  in.dt_bias = d_dt.as<float>();
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(K));
  cuda::DeviceBuffer fq = poisoned(np * 2), fk = poisoned(np * 2), fv = poisoned(np * 2), fg = poisoned(np * 4),
                     fbeta = poisoned(nh * 4);
  ops::kda_prep_decode_cuda({n, H, K, W, q_scale, 1e-6f, -5.0f}, in,
                            {bf16_ptr(fq), bf16_ptr(fk), bf16_ptr(fv), fg.as<float>(), fbeta.as<float>()}, nullptr);

  // Separate kernels.
  std::vector<cuda::DeviceBuffer> sep;
  for (int i = 0; i < 3; ++i) {
    sep.push_back(poisoned(np * 2));
    const ops::ConvStateSlots cs{bf16_ptr(d_pool_sep) + i * part, d_slots.as<int32_t>(), slot_stride};
    const auto u = static_cast<size_t>(i);
    ops::short_conv_decode_cuda({n, P, W}, bf16_ptr(d_x[u]), d_w[u].as<float>(), cs, bf16_ptr(sep.back()), nullptr);
  }
  ops::kda_l2norm_cuda({n * H, K, q_scale, 1e-6f}, bf16_ptr(sep[0]), bf16_ptr(sep[0]), nullptr);
  ops::kda_l2norm_cuda({n * H, K, 1.0f, 1e-6f}, bf16_ptr(sep[1]), bf16_ptr(sep[1]), nullptr);
  cuda::DeviceBuffer sg = poisoned(np * 4), sbeta = poisoned(nh * 4);
  ops::kda_gate_cuda({n, H, K, -5.0f}, bf16_ptr(d_graw), d_alog.as<float>(), d_dt.as<float>(), sg.as<float>(), nullptr);
  ops::kda_beta_cuda(static_cast<int64_t>(nh), bf16_ptr(d_b), sbeta.as<float>(), nullptr);
  sync_device();

  // CPU references on the same bf16 inputs (states advanced alike).
  std::vector<float> cpu_pool = pool;
  std::vector<std::vector<float>> ref(3, std::vector<float>(np, 0.0f));
  for (int64_t s = 0; s < n; ++s) {
    const int32_t slot = slots[static_cast<size_t>(s)];
    if (slot < 0) continue;
    for (int i = 0; i < 3; ++i) {
      ops::short_conv_cpu({1, P, W}, x[static_cast<size_t>(i)].data() + s * P, w[static_cast<size_t>(i)].data(),
                          W > 1 ? cpu_pool.data() + slot * slot_stride + i * part : nullptr,
                          ref[static_cast<size_t>(i)].data() + s * P);
    }
  }
  ops::kda_l2norm_cpu({n * H, K, q_scale, 1e-6f}, ref[0].data(), ref[0].data());
  ops::kda_l2norm_cpu({n * H, K, 1.0f, 1e-6f}, ref[1].data(), ref[1].data());
  std::vector<float> ref_g(np), ref_beta(nh);
  ops::kda_gate_cpu({n, H, K, -5.0f}, g_raw.data(), a_log.data(), dt_bias.data(), ref_g.data());
  ops::kda_beta_cpu(static_cast<int64_t>(nh), b.data(), ref_beta.data());

  const cuda::DeviceBuffer* fused_out[3] = {&fq, &fk, &fv};
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(::testing::Message() << "output " << "qkv"[i]);
    const auto u = static_cast<size_t>(i);
    const std::vector<float> got = download_bf16(*fused_out[i], np), other = download_bf16(sep[u], np);
    std::vector<float> got_valid, other_valid, ref_valid;
    for (int64_t s = 0; s < n; ++s) {
      const auto lo = static_cast<std::ptrdiff_t>(s * P), hi = lo + P;
      if (slots[static_cast<size_t>(s)] < 0) {
        EXPECT_TRUE(std::all_of(got.begin() + lo, got.begin() + hi, [](float v) { return v == 0.0f; }));
        continue;
      }
      got_valid.insert(got_valid.end(), got.begin() + lo, got.begin() + hi);
      other_valid.insert(other_valid.end(), other.begin() + lo, other.begin() + hi);
      ref_valid.insert(ref_valid.end(), ref[u].begin() + lo, ref[u].begin() + hi);
    }
    EXPECT_EQ(first_mismatch(got_valid, other_valid), -1);
    EXPECT_LE(max_rel_error(got_valid, ref_valid), kTolBf16Out);
  }
  const std::vector<float> got_g = cuda::download<float>(fg, np), got_beta = cuda::download<float>(fbeta, nh);
  EXPECT_EQ(first_mismatch(got_g, cuda::download<float>(sg, np)), -1);
  EXPECT_EQ(first_mismatch(got_beta, cuda::download<float>(sbeta, nh)), -1);
  EXPECT_LE(max_rel_error(got_g, ref_g), kTolF32);
  EXPECT_LE(max_rel_error(got_beta, ref_beta), kTolF32);
  const std::vector<float> pool_fused = download_bf16(d_pool_fused, pool.size());
  EXPECT_EQ(first_mismatch(pool_fused, download_bf16(d_pool_sep, pool.size())), -1);
  EXPECT_EQ(first_mismatch(pool_fused, cpu_pool), -1);
}

TEST(KdaPrepParity, K3HeadsMatchTheSeparateKernelsBitForBit) {
  BG_REQUIRE_GPU();
  for (int64_t n : {1, 3, 17, 64}) {
    run_case({n, 96, 128, 4, false});
    run_case({n, 96, 128, 4, false, true});
  }
  run_case({5, 96, 128, 4, true});
  run_case({5, 96, 128, 4, true, true});
  run_case({3, 2, 128, 4, true, true});
  EXPECT_TRUE(ops::kda_prep_w4x128_enabled()) << "BG_KDA_PREP_W4X128=0: the 8-byte conv path was not tested";
}

TEST(KdaPrepParity, OtherShapes) {
  BG_REQUIRE_GPU();
  run_case({4, 3, 16, 4, false});
  run_case({4, 5, 200, 2, true});
  run_case({3, 2, 7, 4, true});
  run_case({2, 4, 256, 4, false});
  run_case({3, 4, 64, 1, false});
}

TEST(KdaPrepParity, RejectsBadParams) {
  BG_REQUIRE_GPU();
  cuda::DeviceBuffer buf(4096);
  ops::KdaPrepDecodeInputs in;
  for (int i = 0; i < 3; ++i) {
    in.x[i] = bf16_ptr(buf);
    in.x_row[i] = 8;
    in.conv_weight[i] = buf.as<float>();
    in.conv_state[i] = {bf16_ptr(buf), buf.as<int32_t>(), 24};
  }
  in.g_raw = bf16_ptr(buf);
  in.g_row = 8;
  in.a_log = in.dt_bias = buf.as<float>();
  in.b = bf16_ptr(buf);
  in.b_row = 2;
  const ops::KdaPrepDecodeOutputs out{bf16_ptr(buf), bf16_ptr(buf), bf16_ptr(buf), buf.as<float>(), buf.as<float>()};
  EXPECT_THROW(ops::kda_prep_decode_cuda({1, 2, 8, 4, 1.0f, 1e-6f, -5.0f}, in, out, nullptr), Error);  // stride < P
  EXPECT_THROW(ops::kda_prep_decode_cuda({1, 2, 300, 4, 1.0f, 1e-6f, -5.0f}, in, out, nullptr), Error);  // K
  EXPECT_THROW(ops::kda_prep_decode_cuda({1, 2, 4, 9, 1.0f, 1e-6f, -5.0f}, in, out, nullptr), Error);  // W
  EXPECT_THROW(ops::kda_prep_decode_cuda({1, 2, 4, 4, 1.0f, 1e-6f, 0.0f}, in, out, nullptr), Error);  // bound
  in.x_row[0] = in.x_row[1] = in.x_row[2] = 8;
  ops::KdaPrepDecodeInputs no_state = in;
  no_state.conv_state[1].base = nullptr;
  EXPECT_THROW(ops::kda_prep_decode_cuda({1, 2, 4, 4, 1.0f, 1e-6f, -5.0f}, no_state, out, nullptr), Error);
}

}  // namespace
}  // namespace bg::testing
