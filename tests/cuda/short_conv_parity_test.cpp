// CUDA short conv + SiLU against short_conv_cpu on bf16-rounded inputs: one-sequence prefill from a non-zero state
// (KDA's 12288 channels, widths 1 / 2 / 4 / 7, ragged token counts), prefill then decode steps, and the batched decode
// over scattered state slots (a -1 slot and rows past the live count are padding: zero output, state untouched).
// Conv states are bf16 on the GPU (they hold past bf16 inputs only), fp32 in the CPU reference: both start from the
// same bf16-rounded values, and the GPU's updated states are compared with the reference's bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/small_ops_testing.h"
#include "ops/kda_gate/kda_gate.h"
#include "ops/kda_gate/kda_gate_cuda.h"
#include "ops/short_conv/short_conv_cuda.h"

namespace bg::testing {
namespace {

constexpr int64_t kChannels = 12288;  // 96 heads x 128

struct ConvCase {
  int64_t n_tokens, n_channels, kernel_size;
};

TEST(ShortConvParity, PrefillFromState) {
  BG_REQUIRE_GPU();
  std::vector<ConvCase> cases;
  for (int64_t t : {1, 2, 3, 17, 128, 1000}) cases.push_back({t, kChannels, 4});
  for (int64_t w : {1, 2, 7}) cases.push_back({5, 96, w});
  for (const ConvCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.n_tokens << " C " << c.n_channels << " W " << c.kernel_size);
    const ops::ShortConvParams p{c.n_tokens, c.n_channels, c.kernel_size};
    const size_t n = static_cast<size_t>(c.n_tokens * c.n_channels);
    const size_t n_state = static_cast<size_t>(c.n_channels * (c.kernel_size - 1));
    std::vector<float> x = random_floats(n, 2.0f, 61);
    const std::vector<float> w = random_floats(static_cast<size_t>(c.n_channels * c.kernel_size), 0.7f, 62);
    std::vector<float> state = random_floats(n_state, 1.5f, 63);  // rounded to bf16 by the upload
    const cuda::DeviceBuffer d_x = upload_bf16(x), d_w = cuda::upload(w);
    cuda::DeviceBuffer d_state = upload_bf16(state), out = poisoned(n * 2);
    std::vector<float> ref(n);
    ops::short_conv_cpu(p, x.data(), w.data(), state.data(), ref.data());
    ops::short_conv_cuda(p, bf16_ptr(d_x), d_w.as<float>(), n_state ? bf16_ptr(d_state) : nullptr, bf16_ptr(out),
                         nullptr);
    sync_device();
    EXPECT_LE(max_rel_error(download_bf16(out, n), ref), kTolBf16Out);
    EXPECT_EQ(first_mismatch(download_bf16(d_state, n_state), state), -1);
  }
}

// The vectorised prefill kernels (widths 1-4, 8 channels x 16 tokens per thread; BG_SHORT_CONV=tiled and rows)
// against the per-element one (BG_SHORT_CONV=scalar) bit for bit, outputs and states, over run edges (T not a
// multiple of 16, T below W - 1) and 64-token tile edges (T around 64, 128 and 256; C not a multiple of the
// 256-channel tile), from a non-zero state, the states also against the CPU's exactly; a misaligned x takes the
// per-element kernel and still matches the CPU.
TEST(ShortConvParity, VectorisedEqualsPerElementBitForBit) {
  BG_REQUIRE_GPU();
  std::vector<ConvCase> cases;
  for (int64_t w : {1, 2, 3, 4}) {
    for (int64_t t : {1, 2, 15, 16, 17, 100, 129}) cases.push_back({t, 256, w});
  }
  for (int64_t c : {8, 72, 264, 520}) {
    for (int64_t t : {3, 127, 128, 255, 257}) cases.push_back({t, c, 4});
  }
  cases.push_back({1000, kChannels, 4});
  for (const ConvCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.n_tokens << " C " << c.n_channels << " W " << c.kernel_size);
    const ops::ShortConvParams p{c.n_tokens, c.n_channels, c.kernel_size};
    const size_t n = static_cast<size_t>(c.n_tokens * c.n_channels);
    const size_t n_state = static_cast<size_t>(c.n_channels * (c.kernel_size - 1));
    std::vector<float> x = random_floats(n, 2.0f, 71);  // rounded to bf16 by the upload
    const std::vector<float> w = random_floats(static_cast<size_t>(c.n_channels * c.kernel_size), 0.7f, 72);
    std::vector<float> state = random_floats(n_state, 1.5f, 73);
    const std::vector<uint16_t> state_bits = to_bf16(state);  // rounds state too: the CPU's start
    const cuda::DeviceBuffer d_x = upload_bf16(x), d_w = cuda::upload(w);
    std::vector<std::vector<float>> outs, states;
    for (const char* kernel : {"scalar", "rows", "tiled"}) {
      ::setenv("BG_SHORT_CONV", kernel, 1);
      cuda::DeviceBuffer d_state = cuda::upload(state_bits), out = poisoned(n * 2);
      ops::short_conv_cuda(p, bf16_ptr(d_x), d_w.as<float>(), n_state ? bf16_ptr(d_state) : nullptr, bf16_ptr(out),
                           nullptr);
      sync_device();
      outs.push_back(download_bf16(out, n));
      states.push_back(download_bf16(d_state, n_state));
    }
    ::unsetenv("BG_SHORT_CONV");
    for (size_t k : {1, 2}) {
      EXPECT_EQ(first_mismatch(outs[k], outs[0]), -1) << "kernel " << k;
      EXPECT_EQ(first_mismatch(states[k], states[0]), -1) << "kernel " << k;
    }
    std::vector<float> ref(n), ref_state = state;
    ops::short_conv_cpu(p, x.data(), w.data(), ref_state.data(), ref.data());
    EXPECT_LE(max_rel_error(outs[1], ref), kTolBf16Out);
    EXPECT_EQ(first_mismatch(states[0], ref_state), -1);
  }
  // x one element off 16-byte alignment: the per-element kernel.
  const int64_t t = 20, ch = 64, width = 4;
  std::vector<float> x = random_floats(static_cast<size_t>((t + 1) * ch), 1.0f, 74);
  const std::vector<float> w = random_floats(static_cast<size_t>(ch * width), 0.7f, 75);
  const cuda::DeviceBuffer d_x = upload_bf16(x), d_w = cuda::upload(w);
  std::vector<float> state(static_cast<size_t>(ch * (width - 1)), 0.0f), ref(static_cast<size_t>(t * ch));
  ops::short_conv_cpu({t, ch, width}, x.data() + 1, w.data(), state.data(), ref.data());
  cuda::DeviceBuffer d_state = cuda::upload(std::vector<uint16_t>(state.size(), 0)), out = poisoned(ref.size() * 2);
  ops::short_conv_cuda({t, ch, width}, bf16_ptr(d_x) + 1, d_w.as<float>(), bf16_ptr(d_state), bf16_ptr(out), nullptr);
  sync_device();
  EXPECT_LE(max_rel_error(download_bf16(out, ref.size()), ref), kTolBf16Out);
  EXPECT_EQ(first_mismatch(download_bf16(d_state, state.size()), state), -1);
}

// The conv with KDA's q / k L2 norm in one launch (short_conv_l2norm_cuda) against short_conv_cuda then
// kda_l2norm_cuda, bit for bit (outputs and states), over token-tile edges, channel tiles with one or two heads,
// head dims 32 / 64 / 128 / 256, widths 2-4, a q scale; head dim 96 (not dividing the 256-channel tile) takes the two
// calls. Also against the CPU reference (short_conv_cpu then kda_l2norm_cpu; the states exactly).
TEST(ShortConvParity, FusedL2NormEqualsConvThenNormBitForBit) {
  BG_REQUIRE_GPU();
  struct NormCase {
    int64_t t, c, w, head_dim;
    float scale;
  };
  const NormCase cases[] = {{1, 256, 4, 128, 0.088f}, {3, 384, 4, 128, 1.0f},   {64, 256, 4, 64, 1.0f},
                            {65, 512, 3, 256, 0.5f},  {200, 384, 4, 128, 0.088f}, {130, 256, 2, 32, 1.0f},
                            {50, 288, 4, 96, 1.0f},   {300, kChannels, 4, 128, 0.088f}};
  for (const NormCase& nc : cases) {
    SCOPED_TRACE(::testing::Message() << "T " << nc.t << " C " << nc.c << " W " << nc.w << " head " << nc.head_dim);
    const ops::ShortConvParams p{nc.t, nc.c, nc.w};
    const ops::ShortConvNorm norm{nc.head_dim, nc.scale, 1e-6f};
    const size_t n = static_cast<size_t>(nc.t * nc.c), n_state = static_cast<size_t>(nc.c * (nc.w - 1));
    std::vector<float> x = random_floats(n, 2.0f, 81);
    const std::vector<float> w = random_floats(static_cast<size_t>(nc.c * nc.w), 0.7f, 82);
    std::vector<float> state = random_floats(n_state, 1.5f, 83);
    const std::vector<uint16_t> state_bits = to_bf16(state);  // rounds state too: the CPU's start
    const cuda::DeviceBuffer d_x = upload_bf16(x), d_w = cuda::upload(w);
    cuda::DeviceBuffer s_two = cuda::upload(state_bits), s_one = cuda::upload(state_bits);
    cuda::DeviceBuffer o_two = poisoned(n * 2), o_one = poisoned(n * 2);
    ops::short_conv_cuda(p, bf16_ptr(d_x), d_w.as<float>(), bf16_ptr(s_two), bf16_ptr(o_two), nullptr);
    ops::kda_l2norm_cuda({nc.t * nc.c / nc.head_dim, nc.head_dim, nc.scale, 1e-6f}, bf16_ptr(o_two), bf16_ptr(o_two),
                         nullptr);
    ops::short_conv_l2norm_cuda(p, norm, bf16_ptr(d_x), d_w.as<float>(), bf16_ptr(s_one), bf16_ptr(o_one), nullptr);
    sync_device();
    const std::vector<float> two = download_bf16(o_two, n), one = download_bf16(o_one, n);
    const std::vector<float> state_one = download_bf16(s_one, n_state);
    EXPECT_EQ(first_mismatch(one, two), -1);
    EXPECT_EQ(first_mismatch(state_one, download_bf16(s_two, n_state)), -1);
    // The CPU reference (x was rounded to bf16 by the upload): the conv, rounded to bf16 as the GPU stores it, then
    // the norm.
    std::vector<float> ref(n), ref_state = state;
    ops::short_conv_cpu(p, x.data(), w.data(), ref_state.data(), ref.data());
    ref = round_bf16(ref);
    ops::kda_l2norm_cpu({nc.t * nc.c / nc.head_dim, nc.head_dim, nc.scale, 1e-6f}, ref.data(), ref.data());
    EXPECT_LE(max_rel_error(one, ref), kTolBf16Out);
    EXPECT_EQ(first_mismatch(state_one, ref_state), -1);
  }
}

TEST(ShortConvParity, PrefillThenDecodeSteps) {
  BG_REQUIRE_GPU();
  const int64_t n_prompt = 9, n_steps = 5, W = 4;
  const size_t n_state = static_cast<size_t>(kChannels * (W - 1));
  std::vector<float> x = random_floats(static_cast<size_t>((n_prompt + n_steps) * kChannels), 1.0f, 64);
  const std::vector<float> w = random_floats(static_cast<size_t>(kChannels * W), 0.7f, 65);
  const cuda::DeviceBuffer d_x = upload_bf16(x), d_w = cuda::upload(w);
  std::vector<float> state(n_state, 0.0f), ref(x.size());
  cuda::DeviceBuffer d_state = upload_bf16(state), out = poisoned(x.size() * 2);
  const cuda::DeviceBuffer d_slot = cuda::upload(std::vector<int32_t>{0});
  ops::short_conv_cpu({n_prompt, kChannels, W}, x.data(), w.data(), state.data(), ref.data());
  ops::short_conv_cuda({n_prompt, kChannels, W}, bf16_ptr(d_x), d_w.as<float>(), bf16_ptr(d_state), bf16_ptr(out),
                       nullptr);
  for (int64_t s = 0; s < n_steps; ++s) {
    const size_t off = static_cast<size_t>((n_prompt + s) * kChannels);
    ops::short_conv_cpu({1, kChannels, W}, x.data() + off, w.data(), state.data(), ref.data() + off);
    const ops::ConvStateSlots slots{bf16_ptr(d_state), d_slot.as<int32_t>(), static_cast<int64_t>(n_state)};
    ops::short_conv_decode_cuda({1, kChannels, W}, bf16_ptr(d_x) + off, d_w.as<float>(), slots, bf16_ptr(out) + off,
                                nullptr);
  }
  sync_device();
  EXPECT_LE(max_rel_error(download_bf16(out, x.size()), ref), kTolBf16Out);
  EXPECT_EQ(first_mismatch(download_bf16(d_state, n_state), state), -1);
}

TEST(ShortConvParity, BatchedDecodeOverSlots) {
  BG_REQUIRE_GPU();
  const int64_t W = 4, n_slots = 300;
  // Pool layout as the KDA state pool: slot -> [3 (q, k, v), C, W-1]; this call convolves the k part.
  const int64_t part = kChannels * (W - 1), slot_stride = 3 * part;
  for (int64_t n_seqs : {1, 3, 17, 128}) {
    SCOPED_TRACE(::testing::Message() << "seqs " << n_seqs);
    std::vector<int32_t> slot_idx(static_cast<size_t>(n_slots));
    std::iota(slot_idx.begin(), slot_idx.end(), 0);
    std::shuffle(slot_idx.begin(), slot_idx.end(), std::mt19937(static_cast<uint32_t>(n_seqs)));
    slot_idx.resize(static_cast<size_t>(n_seqs));
    if (n_seqs > 2) slot_idx[1] = -1;  // a padding row: skipped
    // A decode graph's padding rows past the live count (ConvStateSlots::live_tokens): their slots are real ones that
    // must stay untouched.
    const int64_t live = n_seqs > 3 ? n_seqs - 2 : n_seqs;
    auto padding = [&](int64_t s) { return slot_idx[static_cast<size_t>(s)] < 0 || s >= live; };
    std::vector<float> pool = random_floats(static_cast<size_t>(n_slots * slot_stride), 1.0f, 66);
    std::vector<float> x = random_floats(static_cast<size_t>(n_seqs * kChannels), 1.5f, 67);
    const std::vector<float> w = random_floats(static_cast<size_t>(kChannels * W), 0.7f, 68);
    const cuda::DeviceBuffer d_x = upload_bf16(x), d_w = cuda::upload(w), d_slots = cuda::upload(slot_idx);
    cuda::DeviceBuffer d_pool = upload_bf16(pool), out = poisoned(x.size() * 2);  // pool rounded for the CPU too
    std::vector<float> ref(x.size(), NAN);
    for (int64_t s = 0; s < n_seqs; ++s) {
      const int32_t slot = slot_idx[static_cast<size_t>(s)];
      if (padding(s)) continue;
      float* state = pool.data() + slot * slot_stride + part;
      ops::short_conv_cpu({1, kChannels, W}, x.data() + s * kChannels, w.data(), state, ref.data() + s * kChannels);
    }
    const cuda::DeviceBuffer d_live = cuda::upload(std::vector<int32_t>{static_cast<int32_t>(live)});
    const ops::ConvStateSlots slots{bf16_ptr(d_pool) + part, d_slots.as<int32_t>(), slot_stride,
                                    d_live.as<int32_t>()};
    ops::short_conv_decode_cuda({n_seqs, kChannels, W}, bf16_ptr(d_x), d_w.as<float>(), slots, bf16_ptr(out), nullptr);
    sync_device();
    const std::vector<float> got = download_bf16(out, x.size());
    // Padding rows are written as zeros; the others compared with the reference.
    std::vector<float> got_valid, ref_valid;
    for (int64_t s = 0; s < n_seqs; ++s) {
      const auto b = static_cast<std::ptrdiff_t>(s * kChannels), e = b + kChannels;
      if (padding(s)) {
        EXPECT_TRUE(std::all_of(got.begin() + b, got.begin() + e, [](float v) { return v == 0.0f; })) << "row " << s;
        continue;
      }
      got_valid.insert(got_valid.end(), got.begin() + b, got.begin() + e);
      ref_valid.insert(ref_valid.end(), ref.begin() + b, ref.begin() + e);
    }
    EXPECT_LE(max_rel_error(got_valid, ref_valid), kTolBf16Out);
    // Every slot of the pool, touched or not (q and v parts included), matches the CPU's pool exactly.
    EXPECT_EQ(first_mismatch(download_bf16(d_pool, pool.size()), pool), -1);
  }
}

TEST(ShortConvParity, RejectsBadParams) {
  BG_REQUIRE_GPU();
  cuda::DeviceBuffer b(256);
  EXPECT_THROW(ops::short_conv_cuda({1, 2, 4}, bf16_ptr(b), b.as<float>(), nullptr, bf16_ptr(b) + 8, nullptr), Error);
  EXPECT_THROW(ops::short_conv_cuda({1, 2, 4}, bf16_ptr(b), b.as<float>(), bf16_ptr(b), bf16_ptr(b), nullptr), Error);
  ::setenv("BG_SHORT_CONV", "vector", 1);  // only tiled, rows or scalar
  EXPECT_THROW(ops::short_conv_cuda({1, 8, 4}, bf16_ptr(b), b.as<float>(), bf16_ptr(b), bf16_ptr(b) + 64, nullptr),
               Error);
  ::unsetenv("BG_SHORT_CONV");
  EXPECT_THROW(ops::short_conv_decode_cuda({1, 8, 4}, bf16_ptr(b), b.as<float>(),
                                           {bf16_ptr(b), b.as<int32_t>(), 8}, bf16_ptr(b) + 64, nullptr),
               Error);
}

}  // namespace
}  // namespace bg::testing
