// The FP8 prefill path of the expert FFN (ops/moe/moe_fp8_cuda.h) on random inputs, stage by stage against the host:
// - the x rows' E4M3 codes and scales equal the host quantization (moe_fp8.h) bit for bit, each scale at its expert's
//   place in the VEC128 layout;
// - the converted experts (W4A16 layout -> E4M3 with power-of-two scales) decode to the MXFP4 weights exactly;
// - gate|up (the last group's rows, bf16) equals the product of the quantized x and the weights in double (1e-2 of max,
//   the bf16 output's rounding): cuBLASLt read the codes and both operands' scales where they were put;
// - h's codes equal the host's quantization of GLU(gate, up) computed from those gate|up values (a few codes may differ
//   by the device's and the host's expf / tanhf ulps); y equals the product of the quantized h and the down weights;
// - end to end against the exact CPU reference of the routed path, with the tolerance of E4M3 activations (printed:
//   the path's effect on the result);
// - a rerun from poisoned buffers gives the same bits.
// Kimi-K3 latent (3584 <-> 3072, SiTU, MXFP4 in the W4A16 layout) and DeepSeek-V3 (7168 <-> 2048, SwiGLU, FP8-block
// experts used as stored) shapes, small ones in several groups, the golden models' widths (inter 64: a partial block).
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "cuda/moe_testing.h"
#include "core/dtype.h"
#include "ops/moe/moe_fp8.h"
#include "ops/moe/moe_fp8_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"

namespace bg::ops {
namespace {

using namespace moe_testing;  // NOLINT: the shared MoE test helpers

// End-to-end tolerance against the exact reference: x and h carry E4M3's rounding (up to 2^-4 of each value).
constexpr double kTolFp8Out = 0.1;

struct Fp8Case {
  const char* name;
  ExpertShape shape;
  int64_t top_k, n_used;
  MoeGlu act;
  std::vector<int64_t> token_counts;
  int64_t group_experts = kMoeGroupedMaxGroupExperts;
};

// The exact values of a random test weight [n_out, n_in].
std::vector<float> weight_values(const testing::HostWeight& hw) {
  const int64_t n_out = hw.w.n_out, n_in = hw.w.n_in;
  std::vector<float> v(static_cast<size_t>(n_out * n_in));
  const auto* codes = reinterpret_cast<const uint8_t*>(hw.data.data());
  if (hw.w.format == WeightFormat::kMxfp4) {
    static constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const auto* s = reinterpret_cast<const uint8_t*>(hw.scale.data());
    for (int64_t r = 0; r < n_out; ++r) {
      for (int64_t k = 0; k < n_in; ++k) {
        const uint8_t byte = codes[(r * n_in + k) / 2];
        const int c = k % 2 == 0 ? byte & 0xf : byte >> 4;
        const float mag = kE2m1[c & 7] * std::ldexp(1.0f, s[r * (n_in / 32) + k / 32] - 127);
        v[static_cast<size_t>(r * n_in + k)] = (c & 8) != 0 ? -mag : mag;
      }
    }
  } else {
    const auto* s = reinterpret_cast<const float*>(hw.scale.data());
    const int64_t cb = fp8_blocks(n_in);
    for (int64_t r = 0; r < n_out; ++r) {
      for (int64_t k = 0; k < n_in; ++k) {
        v[static_cast<size_t>(r * n_in + k)] = f8e4m3_to_f32(codes[r * n_in + k]) * s[(r / 128) * cb + k / 128];
      }
    }
  }
  return v;
}

// Host copies of the quantized rows: values code x scale, [rows, width].
std::vector<float> dequantized_rows(const std::vector<uint8_t>& codes, const std::vector<float>& scales,
                                    const MoeGroupedPlan& plan, int64_t width) {
  std::vector<float> v(codes.size());
  const std::vector<int64_t> r0 = fp8_scale_row0(plan);
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    const int64_t rb = plan.row_begin[i], n = plan.rows[i];
    for (int64_t r = rb; r < rb + n; ++r) {
      for (int64_t k = 0; k < width; ++k) {
        const float s = scales[static_cast<size_t>(fp8_row_scale_index(width, r0[i], n, r - rb, k / kFp8BlockInputs))];
        v[static_cast<size_t>(r * width + k)] = f8e4m3_to_f32(codes[static_cast<size_t>(r * width + k)]) * s;
      }
    }
  }
  return v;
}

float glu_host(float g, float u, const MoeGluParams& a) {
  const float sig = 1.0f / (1.0f + std::exp(-g));
  if (a.kind == MoeGlu::kSwiGlu) return g * sig * u;
  return a.beta * std::tanh(g / a.beta) * sig * (a.beta_lin * std::tanh(u / a.beta_lin));
}

// out[r, c] = sum_k a[r, k] w[c, k] in double, rows [r0, r1) of a (row stride k), w [n, k].
std::vector<float> host_gemm(const std::vector<float>& a, int64_t r0, int64_t r1, const std::vector<float>& w,
                             int64_t n, int64_t k) {
  std::vector<float> out(static_cast<size_t>((r1 - r0) * n));
  parallel_for(r1 - r0, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        double acc = 0.0;
        for (int64_t i = 0; i < k; ++i) {
          acc += static_cast<double>(a[static_cast<size_t>((r0 + r) * k + i)]) * w[static_cast<size_t>(c * k + i)];
        }
        out[static_cast<size_t>(r * n + c)] = static_cast<float>(acc);
      }
    }
  });
  return out;
}

void run_fp8_case(const Fp8Case& c, uint64_t seed) {
  const Experts ex = make_experts(c.shape, seed);
  const bool mxfp4 = c.shape.format == WeightFormat::kMxfp4;
  std::optional<MoeW4a16DeviceLayer> packed;
  std::vector<ExpertWeightsCuda> host_descs;
  if (mxfp4) {
    std::vector<MoeW4a16ExpertView> views;
    for (size_t e = 0; e < ex.gate.size(); ++e) views.push_back({&ex.gate[e].w, &ex.up[e].w, &ex.down[e].w});
    packed = moe_w4a16_upload(views, c.shape.hidden, c.shape.inter);
  } else {
    for (size_t e = 0; e < ex.gate.size(); ++e) {
      host_descs.push_back({ex.storage[3 * e].desc, ex.storage[3 * e + 1].desc, ex.storage[3 * e + 2].desc});
    }
  }
  const int64_t E = c.shape.n_experts, H = c.shape.hidden, I = c.shape.inter;
  // [2I, H] gate|up and [H, I] down of each expert, exact.
  std::vector<std::vector<float>> w_gu(static_cast<size_t>(E)), w_down(static_cast<size_t>(E));
  for (size_t e = 0; e < static_cast<size_t>(E); ++e) {
    w_gu[e] = weight_values(ex.gate[e]);
    const std::vector<float> up = weight_values(ex.up[e]);
    w_gu[e].insert(w_gu[e].end(), up.begin(), up.end());
    w_down[e] = weight_values(ex.down[e]);
  }
  testing::CublasFixture blas;
  MoeFp8Gemm gemm;
  for (int64_t n : c.token_counts) {
    const std::string what = fmt::format("{}: {} n={} rows/expert~{} group={}", c.name,
                                         weight_format_name(c.shape.format), n, n * c.top_k / c.n_used,
                                         c.group_experts);
    MoeCudaParams p = params(n, c.top_k, E, E, H, I);
    p.expert_format = c.shape.format;
    p.act = {c.act, 4.0f, 25.0f};
    ASSERT_TRUE(moe_fp8_supported(p, mxfp4, !mxfp4)) << what;
    const Routing r = random_routing(n, c.top_k, c.n_used, seed + static_cast<uint64_t>(n));
    std::vector<float> x;
    const std::vector<uint16_t> x_bits =
        testing::random_bf16(static_cast<size_t>(n * H), 1.0f, seed * 7 + static_cast<uint64_t>(n), &x);
    Workspace w(p, slot_map_every(E, 1));
    cuda::DeviceBuffer d_ids = cuda::upload(r.ids), d_w = cuda::upload(r.weights), d_x = cuda::upload(x_bits);
    cuda::DeviceBuffer d_out(static_cast<size_t>(std::max<int64_t>(1, n * H)) * 2);
    moe_dispatch_cuda(p, d_ids.as<int32_t>(), d_w.as<float>(), w.ws, nullptr);
    moe_gather_cuda(p, d_x.as<__nv_bfloat16>(), w.ws, nullptr);
    const MoeGroupedPlan plan = moe_grouped_plan_from_device(p, w.ws, c.group_experts, nullptr);
    const std::vector<float> want = reference_moe(p, ex, r, x);
    const MoeFp8ExpertLayout el = moe_fp8_expert_layout(H, I);
    const MoeFp8CallLayout cl = moe_fp8_call_layout(plan);
    std::vector<uint16_t> first_bits;
    for (int run = 0; run < 2; ++run) {
      const std::string label = what + (run == 0 ? "" : " rerun");
      for (cuda::DeviceBuffer* b : {&w.y_perm, &d_out}) b->fill_bytes(0xff);
      cuda::DeviceBuffer scratch(std::max<size_t>(1, static_cast<size_t>(c.group_experts) * el.bytes));
      cuda::DeviceBuffer call(std::max<size_t>(1, cl.bytes));
      scratch.fill_bytes(0xff);
      call.fill_bytes(0xff);
      MoeFp8Args a;
      a.plan = &plan;
      a.packed = mxfp4 ? &packed->weights : nullptr;
      a.experts_host = mxfp4 ? nullptr : host_descs.data();
      a.ws = w.ws;
      a.expert_scratch = scratch.data();
      a.expert_scratch_bytes = scratch.bytes();
      a.call_buffer = call.data();
      a.call_buffer_bytes = call.bytes();
      a.gemm = &gemm;
      a.cublas_workspace = blas.workspace.data();
      a.cublas_workspace_bytes = blas.workspace.bytes();
      moe_fp8_write_table(plan, a.call_buffer, a.call_buffer_bytes, nullptr);
      moe_expert_ffn_fp8_cuda(p, a, nullptr);
      moe_combine_cuda(p, w.ws, d_out.data(), nullptr);
      BG_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(w.error_word(), 0) << label;
      const std::vector<uint16_t> bits = cuda::download<uint16_t>(d_out, static_cast<size_t>(n * H));
      if (run == 1) {
        EXPECT_TRUE(bits == first_bits) << label << ": not the first run's bits";
        continue;
      }
      first_bits = bits;
      testing::expect_parity(testing::from_bf16(bits), want, kTolFp8Out, label + " end to end (E4M3 activations)");
      if (plan.n_active() == 0) continue;
      const int64_t rows = plan.row_begin.back() + plan.rows.back();
      const auto* base = static_cast<const uint8_t*>(call.data());
      const auto dl_bytes = [&](size_t off, size_t n_bytes) {
        return download_ptr(base + off, n_bytes);
      };
      const auto dl_floats = [&](size_t off, size_t count) {
        return download_ptr(reinterpret_cast<const float*>(base + off), count);
      };
      // x: the host quantization of the gathered rows, bit for bit.
      const std::vector<float> x_perm =
          testing::from_bf16(download_ptr(reinterpret_cast<const uint16_t*>(w.ws.x_perm), static_cast<size_t>(rows * H)));
      const std::vector<uint8_t> x8 = dl_bytes(cl.x, static_cast<size_t>(rows * H));
      const std::vector<int64_t> r0 = fp8_scale_row0(plan);
      const std::vector<float> xs = dl_floats(cl.x_scale, static_cast<size_t>(r0.back() * fp8_blocks(H)));
      int64_t x_bad = 0;
      for (size_t i = 0; i < plan.slots.size(); ++i) {
        const int64_t rb = plan.row_begin[i], cnt = plan.rows[i];
        for (int64_t row = rb; row < rb + cnt; ++row) {
          for (int64_t b = 0; b < fp8_blocks(H); ++b) {
            float amax = 0.0f;
            const int64_t k1 = std::min(H, (b + 1) * kFp8BlockInputs);
            for (int64_t k = b * kFp8BlockInputs; k < k1; ++k) {
              amax = std::max(amax, std::fabs(x_perm[static_cast<size_t>(row * H + k)]));
            }
            const float s = fp8_activation_scale(amax);
            x_bad += xs[static_cast<size_t>(fp8_row_scale_index(H, r0[i], cnt, row - rb, b))] != s;
            for (int64_t k = b * kFp8BlockInputs; k < k1; ++k) {
              const auto j = static_cast<size_t>(row * H + k);
              x_bad += x8[j] != f32_to_f8e4m3(x_perm[j] / s);
            }
          }
        }
      }
      EXPECT_EQ(x_bad, 0) << label << ": x codes or scales differ from the host quantization";
      const std::vector<float> xq = dequantized_rows(x8, xs, plan, H);
      // The last group: its converted experts (W4A16 layout) and its gate|up rows.
      const MoeGroupedGroup& g = plan.groups.back();
      if (mxfp4) {
        for (int j = 0; j < g.n_experts; ++j) {
          const auto slot = static_cast<size_t>(plan.slots[static_cast<size_t>(g.first + j)]);
          const auto* eb = static_cast<const uint8_t*>(scratch.data()) + static_cast<size_t>(j) * el.bytes;
          const std::vector<uint8_t> gu8 = download_ptr(eb + el.gate_up, static_cast<size_t>(2 * I * H));
          const std::vector<float> gus =
              download_ptr(reinterpret_cast<const float*>(eb + el.gate_up_scale), static_cast<size_t>(2 * I * fp8_blocks(H)));
          const std::vector<uint8_t> dn8 = download_ptr(eb + el.down, static_cast<size_t>(H * I));
          const std::vector<float> dns =
              download_ptr(reinterpret_cast<const float*>(eb + el.down_scale), static_cast<size_t>(H * fp8_blocks(I)));
          int64_t bad = 0;
          for (int64_t row = 0; row < 2 * I; ++row) {
            for (int64_t k = 0; k < H; ++k) {
              const float v = f8e4m3_to_f32(gu8[static_cast<size_t>(row * H + k)]) *
                              gus[static_cast<size_t>((k / kFp8BlockInputs) * 2 * I + row)];
              bad += v != w_gu[slot][static_cast<size_t>(row * H + k)];
            }
          }
          for (int64_t row = 0; row < H; ++row) {
            for (int64_t k = 0; k < I; ++k) {
              const float v = f8e4m3_to_f32(dn8[static_cast<size_t>(row * I + k)]) *
                              dns[static_cast<size_t>((k / kFp8BlockInputs) * H + row)];
              bad += v != w_down[slot][static_cast<size_t>(row * I + k)];
            }
          }
          EXPECT_EQ(bad, 0) << label << ": expert " << slot << "'s E4M3 conversion is not its MXFP4 weights";
        }
      }
      const std::vector<float> gu = testing::from_bf16(
          download_ptr(reinterpret_cast<const uint16_t*>(base + cl.gu), static_cast<size_t>(g.n_rows * 2 * I)));
      std::vector<float> gu_ref;
      for (int j = 0; j < g.n_experts; ++j) {
        const auto i = static_cast<size_t>(g.first + j);
        const std::vector<float> part = host_gemm(xq, plan.row_begin[i], plan.row_begin[i] + plan.rows[i],
                                                  w_gu[static_cast<size_t>(plan.slots[i])], 2 * I, H);
        gu_ref.insert(gu_ref.end(), part.begin(), part.end());
      }
      testing::expect_parity(gu, gu_ref, testing::kTolBf16Out, label + " gate|up = x8 W^T (last group)");
      // h: the host quantization of GLU(gate, up) from the device's gate|up (the last group's rows).
      const std::vector<uint8_t> h8 = dl_bytes(cl.h, static_cast<size_t>(rows * I));
      const std::vector<float> hs = dl_floats(cl.h_scale, static_cast<size_t>(r0.back() * fp8_blocks(I)));
      int64_t h_codes = 0, h_off = 0, h_far = 0;
      for (int j = 0; j < g.n_experts; ++j) {
        const auto i = static_cast<size_t>(g.first + j);
        const int64_t rb = plan.row_begin[i], cnt = plan.rows[i];
        for (int64_t row = rb; row < rb + cnt; ++row) {
          const int64_t gr = row - g.row_begin;
          for (int64_t b = 0; b < fp8_blocks(I); ++b) {
            const int64_t k1 = std::min(I, (b + 1) * kFp8BlockInputs);
            std::vector<float> hv;
            float amax = 0.0f;
            for (int64_t k = b * kFp8BlockInputs; k < k1; ++k) {
              hv.push_back(glu_host(gu[static_cast<size_t>(gr * 2 * I + k)],
                                    gu[static_cast<size_t>(gr * 2 * I + I + k)], p.act));
              amax = std::max(amax, std::fabs(hv.back()));
            }
            const float s = fp8_activation_scale(amax);
            const float got_s = hs[static_cast<size_t>(fp8_row_scale_index(I, r0[i], cnt, row - rb, b))];
            h_far += std::fabs(got_s - s) > 1e-5f * s;
            for (int64_t k = b * kFp8BlockInputs; k < k1; ++k) {
              const uint8_t want_code = f32_to_f8e4m3(hv[static_cast<size_t>(k - b * kFp8BlockInputs)] / s);
              const uint8_t got_code = h8[static_cast<size_t>(row * I + k)];
              ++h_codes;
              if (got_code == want_code) continue;
              ++h_off;  // a rounding boundary met through expf / tanhf ulps: one code step at most
              h_far += std::abs((got_code & 0x7f) - (want_code & 0x7f)) > 1 || ((got_code ^ want_code) & 0x80) != 0;
            }
          }
        }
      }
      EXPECT_EQ(h_far, 0) << label << ": h scales or codes far from the host's";
      EXPECT_LE(h_off, h_codes / 200 + 4) << label << ": " << h_off << " of " << h_codes << " h codes off by one";
      // y: the quantized h times the down weights (every row).
      const std::vector<float> hq = dequantized_rows(h8, hs, plan, I);
      const std::vector<float> y = testing::from_bf16(
          download_ptr(reinterpret_cast<const uint16_t*>(w.ws.y_perm), static_cast<size_t>(rows * H)));
      std::vector<float> y_ref;
      for (size_t i = 0; i < plan.slots.size(); ++i) {
        const std::vector<float> part = host_gemm(hq, plan.row_begin[i], plan.row_begin[i] + plan.rows[i],
                                                  w_down[static_cast<size_t>(plan.slots[i])], H, I);
        y_ref.insert(y_ref.end(), part.begin(), part.end());
      }
      testing::expect_parity(y, y_ref, testing::kTolBf16Out, label + " y = h8 W_down^T");
    }
  }
}

TEST(MoeFp8Parity, KimiK3LatentExpertsFromTheW4a16Layout) {
  BG_REQUIRE_GPU();
  // 6 experts, 5 chosen, top-2: about 60 rows per expert; one group.
  run_fp8_case({"kimi-k3", {6, 3584, 3072, WeightFormat::kMxfp4}, 2, 5, MoeGlu::kSitu, {150}}, 201);
}

TEST(MoeFp8Parity, DeepSeekV3Fp8BlockExpertsAsStored) {
  BG_REQUIRE_GPU();
  // The checkpoint's E4M3 weights and 128 x 128 scales straight into cuBLASLt (BLK128x128 A scales).
  run_fp8_case({"deepseek-v3", {6, 7168, 2048, WeightFormat::kFp8Block}, 2, 5, MoeGlu::kSwiGlu, {100}}, 202);
}

TEST(MoeFp8Parity, SmallExpertsInSeveralGroups) {
  BG_REQUIRE_GPU();
  // 24 experts, 20 chosen, top-4: groups of 3 (the scratch reused), 1 to ~100 rows per expert (odd counts).
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kFp8Block}) {
    run_fp8_case({"small situ", {24, 256, 128, f}, 4, 20, MoeGlu::kSitu, {1, 37, 500}, 3}, 203);
    run_fp8_case({"small swiglu", {24, 512, 384, f}, 4, 20, MoeGlu::kSwiGlu, {300}, 7}, 204);
  }
}

TEST(MoeFp8Parity, GoldenModelWidths) {
  BG_REQUIRE_GPU();
  // hidden 128, inter 64 (the golden models): down's K is half a scale block.
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kFp8Block}) {
    run_fp8_case({"golden widths", {16, 128, 64, f}, 4, 16, MoeGlu::kSitu, {9, 64}}, 205);
  }
}

TEST(MoeFp8Parity, UnsupportedLayersAreRefused) {
  BG_REQUIRE_GPU();
  MoeCudaParams p = params(64, 4, 16, 16, 256, 128);
  p.expert_format = WeightFormat::kDense;
  EXPECT_FALSE(moe_fp8_supported(p, false, true));     // bf16 experts
  p.expert_format = WeightFormat::kMxfp4;
  EXPECT_FALSE(moe_fp8_supported(p, false, true));     // MXFP4 outside the W4A16 layout
  EXPECT_TRUE(moe_fp8_supported(p, true, false));
  p.hidden = 200;
  EXPECT_FALSE(moe_fp8_supported(p, true, false));     // rows not 16-byte aligned in E4M3
  p.hidden = 256;
  p.expert_format = WeightFormat::kDense;
  const MoeGroupedPlan plan = moe_grouped_plan(std::vector<int32_t>(16, 16), 256, 128, 16, 64 * 4);
  MoeFp8Gemm gemm;
  MoeFp8Args a;
  a.plan = &plan;
  a.experts_host = reinterpret_cast<const ExpertWeightsCuda*>(&p);  // never read: refused before
  a.gemm = &gemm;
  try {
    moe_expert_ffn_fp8_cuda(p, a, nullptr);
    ADD_FAILURE() << "bf16 experts were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not supported"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace bg::ops
