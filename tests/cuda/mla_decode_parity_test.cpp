// MLA decode kernel (mla_decode_cuda.h) against the CPU reference mla_attention_cpu, for both tensor-core policies
// (suites MmaSync/... and Wgmma/...): K3 (96 heads) and DeepSeek (128 heads, padded head group) shapes, contexts 1 to
// 32k, batches 1-64 with ragged contexts, shuffled paged blocks of several sizes in a poisoned two-layer pool,
// forced partition counts (no split, many splits), the device schedule against its host model, bitwise equality of
// two runs and of a graph replay (with new positions) against the eager launch, error flags for bad step layouts,
// and rejected inputs.
// Bound: relative L2 error per token <= 1e-2 (bf16 q_abs, P, o_lat and output roundings; fp32 accumulation), and
// max |error| <= 2e-2 of max |ref|; NaN never passes (outputs and workspace are poisoned with 0xff first).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_testing.h"
#include "ops/mla/mla.h"
#include "ops/mla/mla_decode_bench.h"
#include "ops/mla/mla_decode_cuda.h"

namespace bg::ops {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;
using testing::from_bf16;
using testing::random_floats;
using testing::to_bf16;

struct Shape {
  int64_t heads, nope, v;
  float scale;
};
const Shape kK3{96, 128, 128, 1.0f / std::sqrt(192.0f)};
const Shape kDeepSeek{128, 128, 128, 0.135234f};  // 192^-0.5 * yarn mscale^2 (factor 40)
constexpr int64_t kLayers = 2, kLayer = 1;        // two MLA layers in the pool; layer 1 is read (stride != size)
constexpr double kTolL2 = 1e-2, kTolMax = 2e-2;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One decode token per sequence; sequence s holds ctx[s] written cache positions on shuffled physical blocks of a
// [n_blocks, 2 layers, block, 576] bf16 pool whose other entries stay NaN (0xffff).
struct PagedPool {
  int64_t block = 0, n_blocks = 0, max_blocks = 0;
  std::vector<int32_t> tables;              // [n_seqs, max_blocks], -1 past a sequence's blocks
  std::vector<std::vector<float>> latents;  // per sequence [nb * block, 576] fp32 (bf16 values)
  DeviceBuffer pool, d_tables;

  PagedPool(const std::vector<int64_t>& ctx, int64_t block_size, uint64_t seed) : block(block_size) {
    std::mt19937_64 rng(seed);
    for (int64_t c : ctx) {
      n_blocks += ceil_div(c, block);
      max_blocks = std::max(max_blocks, ceil_div(c, block) + 1);  // one spare (-1) entry, never read
    }
    n_blocks += 3;  // blocks nobody owns
    std::vector<int32_t> physical(static_cast<size_t>(n_blocks));
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), rng);
    tables.assign(ctx.size() * static_cast<size_t>(max_blocks), -1);
    std::vector<uint16_t> host(static_cast<size_t>(n_blocks * kLayers * block * 576), 0xffff);
    size_t next = 0;
    for (size_t s = 0; s < ctx.size(); ++s) {
      const int64_t nb = ceil_div(ctx[s], block);
      std::vector<float> lat = random_floats(static_cast<size_t>(ctx[s] * 576), 1.0f, seed * 977 + s);
      const std::vector<uint16_t> bits = to_bf16(lat);
      for (int64_t b = 0; b < nb; ++b) {
        const int32_t phys = physical[next++];
        tables[s * static_cast<size_t>(max_blocks) + static_cast<size_t>(b)] = phys;
        const int64_t n_in_block = std::min(block, ctx[s] - b * block);
        std::copy_n(bits.begin() + b * block * 576, n_in_block * 576,
                    host.begin() + ((phys * kLayers + kLayer) * block) * 576);
      }
      lat.resize(static_cast<size_t>(nb * block * 576), 0.0f);
      latents.push_back(std::move(lat));
    }
    pool = cuda::upload(host);
    d_tables = cuda::upload(tables);
  }

  MlaPagedCache view(const DeviceBuffer& seq_idx, const DeviceBuffer& positions) const {
    MlaPagedCache c;
    c.base = pool.as<bf16>() + kLayer * block * 576;
    c.block_stride = kLayers * block * 576;
    c.block_tables = d_tables.as<int32_t>();
    c.max_blocks_per_seq = max_blocks;
    c.seq_idx = seq_idx.as<int32_t>();
    c.positions = positions.as<int64_t>();
    return c;
  }
};

// Device inputs of one decode launch and everything needed to run it and check it.
struct DecodeCase {
  Shape shape;
  std::vector<int64_t> ctx;  // context length per sequence (position = ctx - 1), also the written cache
  int64_t block = 64;
  MlaDecodeOptions options;
  uint64_t seed = 1;

  std::vector<float> q, w_uk, w_uv;
  std::vector<int64_t> positions;
  PagedPool pool;
  DeviceBuffer d_q, d_uk, d_uv, d_out, d_seq, d_pos, d_ws, d_cublas_ws;
  cublasHandle_t cublas = nullptr;
  MlaDecodePlan plan;
  int32_t* error_flags = nullptr;  // device word handed to the launch (MlaPagedCache::error_flags), optional

  DecodeCase(const Shape& s, std::vector<int64_t> contexts, int64_t block_size, MlaDecodeOptions o, uint64_t sd)
      : shape(s), ctx(std::move(contexts)), block(block_size), options(o), seed(sd), pool(ctx, block_size, sd) {
    const int64_t n = n_tokens(), h = s.heads, qk = s.nope + 64;
    const float w_scale = 1.0f / std::sqrt(512.0f);
    q = random_floats(static_cast<size_t>(n * h * qk), 1.0f, sd + 1);
    w_uk = random_floats(static_cast<size_t>(h * s.nope * 512), w_scale, sd + 2);
    w_uv = random_floats(static_cast<size_t>(h * s.v * 512), w_scale, sd + 3);
    d_q = cuda::upload(to_bf16(q));
    d_uk = cuda::upload(to_bf16(w_uk));
    d_uv = cuda::upload(to_bf16(w_uv));
    std::vector<int32_t> seq_idx(static_cast<size_t>(n));
    std::iota(seq_idx.begin(), seq_idx.end(), 0);
    for (int64_t c : ctx) positions.push_back(c - 1);
    d_seq = cuda::upload(seq_idx);
    d_pos = cuda::upload(positions);
    d_out = DeviceBuffer(static_cast<size_t>(n * h * s.v) * 2);
    plan = mla_decode_plan(params(), 132, options);
    d_ws = DeviceBuffer(plan.ws.total_bytes);
    d_cublas_ws = DeviceBuffer(size_t{32} << 20);
    BG_CUBLAS_CHECK(cublasCreate(&cublas));
  }
  ~DecodeCase() { cublasDestroy(cublas); }
  DecodeCase(const DecodeCase&) = delete;
  DecodeCase& operator=(const DecodeCase&) = delete;

  int64_t n_tokens() const { return static_cast<int64_t>(ctx.size()); }
  MlaParams params() const {
    return {n_tokens(), shape.heads, 512, shape.nope, 64, shape.v, block, shape.scale};
  }
  // Poisons output and workspace, launches (not synchronised), and returns nothing: see download().
  void launch(cudaStream_t stream) {
    BG_CUDA_CHECK(cudaMemsetAsync(d_out.data(), 0xff, d_out.bytes(), stream));
    BG_CUDA_CHECK(cudaMemsetAsync(d_ws.data(), 0xff, d_ws.bytes(), stream));
    launch_only(stream);
  }
  void launch_only(cudaStream_t stream) {
    const MlaDecodeContext c{cublas, d_cublas_ws.data(), d_cublas_ws.bytes(), d_ws.data(), d_ws.bytes()};
    MlaPagedCache cache = pool.view(d_seq, d_pos);
    cache.error_flags = error_flags;
    mla_decode_cuda(plan, {d_q.as<bf16>(), d_uk.as<bf16>(), d_uv.as<bf16>(), d_out.as<bf16>()}, cache, c, stream);
  }
  std::vector<uint16_t> run() {
    launch(nullptr);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    return download();
  }
  std::vector<uint16_t> download() const {
    return cuda::download<uint16_t>(d_out, static_cast<size_t>(n_tokens() * shape.heads * shape.v));
  }
  void set_positions(std::vector<int64_t> pos) {
    positions = std::move(pos);
    cuda::DeviceBuffer fresh = cuda::upload(positions);
    BG_CUDA_CHECK(cudaMemcpy(d_pos.data(), fresh.data(), d_pos.bytes(), cudaMemcpyDeviceToDevice));
  }

  // Checks the tokens in `checked` (all when empty) of a downloaded output against mla_attention_cpu.
  void check(const std::vector<uint16_t>& bits, std::vector<size_t> checked = {}) const {
    if (checked.empty()) {
      checked.resize(ctx.size());
      std::iota(checked.begin(), checked.end(), size_t{0});
    }
    const std::vector<float> got = from_bf16(bits);
    const int64_t h = shape.heads, qk = shape.nope + 64;
    const size_t row = static_cast<size_t>(h * shape.v);
    double worst_l2 = 0.0, worst_max = 0.0;
    for (size_t i : checked) {
      const std::vector<float>& lat = pool.latents[i];
      std::vector<const float*> blocks;
      for (size_t off = 0; off < lat.size(); off += static_cast<size_t>(block * 576)) blocks.push_back(&lat[off]);
      MlaParams one = params();
      one.n_tokens = 1;
      std::vector<float> ref(row);
      mla_attention_cpu(one, q.data() + i * static_cast<size_t>(h * qk), w_uk.data(), w_uv.data(), blocks.data(),
                        &positions[i], ref.data());
      const std::vector<float> got_row(got.begin() + static_cast<std::ptrdiff_t>(i * row),
                                       got.begin() + static_cast<std::ptrdiff_t>((i + 1) * row));
      double diff2 = 0.0, ref2 = 0.0;
      bool finite = true;
      for (size_t k = 0; k < row; ++k) {
        finite = finite && std::isfinite(got_row[k]);
        diff2 += (static_cast<double>(got_row[k]) - ref[k]) * (static_cast<double>(got_row[k]) - ref[k]);
        ref2 += static_cast<double>(ref[k]) * ref[k];
      }
      const double l2 = finite ? std::sqrt(diff2 / std::max(ref2, 1e-30)) : INFINITY;
      const double mx = testing::max_rel_error(got_row, ref);
      worst_l2 = std::max(worst_l2, l2);
      worst_max = std::max(worst_max, mx);
      ASSERT_LE(l2, kTolL2) << "token " << i << " (context " << positions[i] + 1 << "): relative L2 error";
      ASSERT_LE(mx, kTolMax) << "token " << i << " (context " << positions[i] + 1 << "): max error / max |ref|";
    }
    std::printf("[mla_decode %s] heads %lld block %lld, %lld tokens (%zu checked), %lld partitions x %lld groups: "
                "rel L2 %.2e, max %.2e\n",
                mla_decode_mma_name(plan.mma), static_cast<long long>(h), static_cast<long long>(block),
                static_cast<long long>(n_tokens()), checked.size(), static_cast<long long>(plan.n_partitions),
                static_cast<long long>(plan.n_groups), worst_l2, worst_max);
  }
};

std::vector<int64_t> ragged(size_t n, uint64_t seed, int64_t max_ctx) {
  const std::vector<int64_t> edges = {1, 63, 64, 65, 1000, 4096};
  std::mt19937_64 rng(seed);
  std::vector<int64_t> v;
  for (size_t i = 0; i < n; ++i) {
    const int64_t c = i < edges.size() ? edges[i] : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(max_ctx));
    v.push_back(std::min(c, max_ctx));
  }
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

class MlaDecode : public ::testing::TestWithParam<MlaDecodeMma> {
 protected:
  // The token-aligned schedule allowed (MlaDecodeOptions::align_tokens, the default): the cases run it wherever it
  // pays and the even cut elsewhere.
  MlaDecodeOptions options(int64_t n_partitions = 0, int64_t min_tiles = 2) const {
    return {GetParam(), n_partitions, min_tiles, false, true};
  }
  void check_case(const Shape& s, const std::vector<int64_t>& ctx, int64_t block, MlaDecodeOptions o, uint64_t seed) {
    DecodeCase c(s, ctx, block, o, seed);
    c.check(c.run());
  }
};

TEST_P(MlaDecode, K3SingleTokenContexts) {
  BG_REQUIRE_GPU();
  for (int64_t ctx : {1, 63, 64, 65, 1000, 4096}) {
    SCOPED_TRACE(::testing::Message() << "context " << ctx);
    check_case(kK3, {ctx}, 64, options(), 100 + static_cast<uint64_t>(ctx));
  }
}

TEST_P(MlaDecode, K3Batches) {
  BG_REQUIRE_GPU();
  check_case(kK3, {63, 64, 65}, 64, options(), 201);
  check_case(kK3, ragged(16, 202, 4096), 64, options(), 203);
  check_case(kK3, ragged(64, 204, 2048), 64, options(), 205);
}

TEST_P(MlaDecode, DeepSeekHeadsPaddedGroup) {
  BG_REQUIRE_GPU();
  check_case(kDeepSeek, {4096}, 64, options(), 301);
  check_case(kDeepSeek, ragged(16, 302, 4096), 64, options(), 303);
}

TEST_P(MlaDecode, LongContext32k) {
  BG_REQUIRE_GPU();
  check_case(kK3, {32768}, 64, options(), 401);
  check_case(kDeepSeek, {32768, 777}, 64, options(), 402);
}

TEST_P(MlaDecode, BlockSizes) {
  BG_REQUIRE_GPU();
  // Tiles that span several blocks (16, 5: not a power of two, 1) and blocks holding several tiles (256).
  for (int64_t block : {16, 5, 1, 256}) {
    SCOPED_TRACE(::testing::Message() << "block " << block);
    check_case(kK3, {1, 65, 700, 1500}, block, options(), 500 + static_cast<uint64_t>(block));
  }
}

TEST_P(MlaDecode, OtherHeadCountsAndHeadDims) {
  BG_REQUIRE_GPU();
  check_case({8, 128, 128, 0.1f}, {1, 300, 2000}, 64, options(), 601);   // one group of 16, 8 padded
  check_case({16, 64, 96, 0.1f}, {70, 1000}, 64, options(), 602);        // exactly 16
  check_case({40, 128, 128, 0.1f}, {129, 3000}, 64, options(), 603);     // one group of 48, 8 padded
  check_case({64, 128, 128, 0.1f}, {64, 2500}, 64, options(), 604);      // two groups of 32
  check_case({96, 20, 40, 0.1f}, {5, 1234}, 64, options(), 605);         // q_pe at an unaligned offset: scalar copy
}

TEST_P(MlaDecode, PartitionExtremes) {
  BG_REQUIRE_GPU();
  const std::vector<int64_t> ctx = ragged(12, 701, 3000);
  check_case(kK3, ctx, 64, options(1, 1), 702);      // one partition: no token is split, one CTA walks them all
  check_case(kK3, ctx, 64, options(7, 1), 703);      // few partitions: most tokens split
  check_case(kK3, {4096}, 64, options(1024, 1), 704);  // one tile per partition: 64 pieces of one token
  check_case(kK3, {1, 1, 1, 1, 5000}, 64, options(200, 1), 705);
  // Whole tokens (the token-aligned schedule, ScheduleMatchesHostModel checks that it is taken): a one-tile token
  // before eight of 16 tiles on 8 partitions and before ten on 10 (the first partition holds two).
  const std::vector<int64_t> eight = {40, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000};
  check_case(kK3, eight, 64, options(8, 1), 706);
  MlaDecodeOptions even = options(8, 1);
  even.align_tokens = false;
  check_case(kK3, eight, 64, even, 708);  // the same batch cut evenly: every token of 16 tiles split
  check_case(kK3, std::vector<int64_t>(8, 1000), 64, options(9, 1), 709);  // 8 merges do not pay a tile: even
  check_case(kK3, {40, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000}, 64, options(10, 1), 707);
}

// The device's schedule equals mla_decode_schedule_cpu's, with the even cut (ragged batch) and with whole tokens.
void check_schedule_case(const Shape& shape, const std::vector<int64_t>& ctx, const MlaDecodeOptions& o,
                         uint64_t seed, bool aligned) {
  DecodeCase c(shape, ctx, 64, o, seed);
  c.run();
  const MlaDecodeSchedule want = mla_decode_schedule_cpu(c.plan, c.positions.data());
  EXPECT_EQ(want.aligned, aligned);
  const int64_t n = c.n_tokens();
  std::vector<int32_t> meta(static_cast<size_t>(MlaDecodeMeta::count(n, c.plan.n_partitions)));
  BG_CUDA_CHECK(cudaMemcpy(meta.data(), static_cast<uint8_t*>(c.d_ws.data()) + c.plan.ws.meta, meta.size() * 4,
                           cudaMemcpyDeviceToHost));
  EXPECT_EQ(meta[MlaDecodeMeta::kTotalTiles], want.total_tiles);
  EXPECT_EQ(meta[MlaDecodeMeta::kPartitionsUsed], want.n_used);
  for (int64_t t = 0; t <= n; ++t) EXPECT_EQ(meta[MlaDecodeMeta::kTilePrefix + t], want.tile_prefix[t]) << t;
  for (int64_t t = 0; t < n; ++t) {
    EXPECT_EQ(meta[MlaDecodeMeta::n_splits(n) + t], want.n_splits[t]) << t;
    EXPECT_EQ(meta[MlaDecodeMeta::slot_base(n) + t], want.slot_base[t]) << t;
    EXPECT_EQ(meta[MlaDecodeMeta::first_partition(n) + t], want.first_partition[t]) << t;
  }
  for (int64_t g = 0; g <= c.plan.n_partitions; ++g) {
    EXPECT_EQ(meta[MlaDecodeMeta::partition_begin(n) + g], want.partition_begin[g]) << g;
  }
}

TEST_P(MlaDecode, ScheduleMatchesHostModel) {
  BG_REQUIRE_GPU();
  check_schedule_case(kK3, ragged(40, 801, 4096), options(), 802, false);
  check_schedule_case(kK3, {40, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000}, options(8, 1), 803, true);
  check_schedule_case(kK3, std::vector<int64_t>(8, 1000), options(9, 1), 806, false);
  check_schedule_case(kK3, {40, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000}, options(10, 1), 804,
                      true);
  MlaDecodeOptions off = options(8, 1);
  off.align_tokens = false;
  check_schedule_case(kK3, {40, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000}, off, 805, false);
}

TEST_P(MlaDecode, DeterministicAndGraphReplayMatchesEager) {
  BG_REQUIRE_GPU();
  DecodeCase c(kK3, ragged(16, 901, 4096), 64, options(), 902);
  const std::vector<uint16_t> first = c.run(), second = c.run();
  EXPECT_TRUE(first == second) << "two launches on the same inputs differ";
  c.check(first);

  cudaStream_t stream = nullptr;
  BG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BG_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  c.launch_only(stream);
  BG_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  BG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // The graph reads positions from device memory: replay with shorter contexts than at capture.
  std::vector<int64_t> shorter = c.positions;
  for (size_t i = 0; i < shorter.size(); ++i) shorter[i] = i % 3 == 0 ? shorter[i] / 2 : shorter[i];
  c.set_positions(shorter);
  const std::vector<uint16_t> eager = c.run();
  BG_CUDA_CHECK(cudaMemset(c.d_out.data(), 0xff, c.d_out.bytes()));
  BG_CUDA_CHECK(cudaMemset(c.d_ws.data(), 0xff, c.d_ws.bytes()));
  BG_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  BG_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> replayed = c.download();
  EXPECT_TRUE(eager == replayed) << "graph replay differs from the eager launch";
  c.check(replayed);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The per-token plan (--deterministic): a token's output bits do not depend on the other tokens of the step. With
// the default plan, shortening the other contexts moves token 0's cut points.
TEST_P(MlaDecode, PerTokenPlanIsBatchInvariant) {
  BG_REQUIRE_GPU();
  MlaDecodeOptions o = options();
  o.per_token = true;
  DecodeCase c(kK3, ragged(16, 911, 4096), 64, o, 912);
  const std::vector<uint16_t> full = c.run();
  c.check(full);
  std::vector<int64_t> others = c.positions;
  for (size_t i = 4; i < others.size(); ++i) others[i] /= 3;
  c.set_positions(others);
  const std::vector<uint16_t> changed = c.run();
  c.check(changed);
  const auto row = static_cast<std::ptrdiff_t>(c.shape.heads * c.shape.v);
  for (std::ptrdiff_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::equal(full.begin() + i * row, full.begin() + (i + 1) * row, changed.begin() + i * row))
        << "token " << i << " changed with the other tokens' contexts";
  }
}

// Step-layout bugs are reported through the error word and leave the CUDA context usable.
TEST_P(MlaDecode, BadPositionsAndBlockEntriesRaiseErrorFlags) {
  BG_REQUIRE_GPU();
  DecodeCase c(kK3, {100, 200}, 64, options(), 1101);  // tables 5 entries wide: seq 0 owns 2 blocks, seq 1 owns 4
  DeviceBuffer flags = cuda::upload(std::vector<int32_t>{0});
  c.error_flags = flags.as<int32_t>();
  auto run_flags = [&](std::vector<int64_t> positions) {
    c.set_positions(std::move(positions));
    BG_CUDA_CHECK(cudaMemset(flags.data(), 0, 4));
    c.run();
    return cuda::download<int32_t>(flags, 1)[0];
  };
  EXPECT_EQ(run_flags({99, 5 * 64}), kMlaErrorBadPosition) << "position past the 5-entry table";
  EXPECT_EQ(run_flags({-1, 199}), kMlaErrorBadPosition) << "negative position";
  EXPECT_EQ(run_flags({150, 199}), kMlaErrorBadBlock) << "seq 0's third table entry is -1";
  EXPECT_EQ(run_flags({99, 199}), 0);
  c.check(c.download());  // the context still works and the good step is right
}

TEST_P(MlaDecode, RejectsBadInput) {
  BG_REQUIRE_GPU();
  MlaParams p{4, 96, 512, 128, 64, 128, 64, 0.1f};
  p.kv_lora_rank = 256;
  EXPECT_THROW(mla_decode_plan(p, 132, options()), Error);  // the general kernel's shapes
  p.kv_lora_rank = 512;
  p.qk_rope_dim = 32;
  EXPECT_THROW(mla_decode_plan(p, 132, options()), Error);
  p.qk_rope_dim = 64;
  p.n_tokens = 0;
  EXPECT_THROW(mla_decode_plan(p, 132, options()), Error);

  DecodeCase c(kK3, {10, 20}, 64, options(), 1001);
  const MlaDecodeTensors t{c.d_q.as<bf16>(), c.d_uk.as<bf16>(), c.d_uv.as<bf16>(), c.d_out.as<bf16>()};
  const MlaPagedCache cache = c.pool.view(c.d_seq, c.d_pos);
  MlaDecodeContext ctx{c.cublas, c.d_cublas_ws.data(), c.d_cublas_ws.bytes(), c.d_ws.data(), c.d_ws.bytes()};
  EXPECT_NO_THROW(mla_decode_cuda(c.plan, t, cache, ctx, nullptr));
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  MlaDecodeContext small = ctx;
  small.workspace_bytes = c.plan.ws.total_bytes - 1;
  EXPECT_THROW(mla_decode_cuda(c.plan, t, cache, small, nullptr), Error);
  MlaPagedCache misaligned = cache;
  misaligned.base += 1;
  EXPECT_THROW(mla_decode_cuda(c.plan, t, misaligned, ctx, nullptr), Error);
  MlaDecodeTensors null_q = t;
  null_q.q = nullptr;
  EXPECT_THROW(mla_decode_cuda(c.plan, null_q, cache, ctx, nullptr), Error);
}

std::string mma_name(const ::testing::TestParamInfo<MlaDecodeMma>& info) {
  switch (info.param) {
    case MlaDecodeMma::kWgmma: return "Wgmma";
    case MlaDecodeMma::kWgmmaHeadsM: return "WgmmaHeadsM";
    case MlaDecodeMma::kMmaSync: break;
  }
  return "MmaSync";
}

// Separate instantiations so a failure (or a fault) of one policy does not hide the other's result; ctest runs every
// case in its own process.
INSTANTIATE_TEST_SUITE_P(MmaSync, MlaDecode, ::testing::Values(MlaDecodeMma::kMmaSync), mma_name);
INSTANTIATE_TEST_SUITE_P(Wgmma, MlaDecode, ::testing::Values(MlaDecodeMma::kWgmma), mma_name);
INSTANTIATE_TEST_SUITE_P(WgmmaHeadsM, MlaDecode, ::testing::Values(MlaDecodeMma::kWgmmaHeadsM), mma_name);

// Manual micro-benchmark (not a CI test): K3 shapes, B = 1/16/64 x context 4k/32k, every policy. Run with
//   build-cuda/tests/test_cuda --gtest_also_run_disabled_tests --gtest_filter='MlaDecodeBench.*'
TEST(MlaDecodeBench, DISABLED_K3Shapes) {
  BG_REQUIRE_GPU();
  const std::vector<MlaDecodeBenchResult> results = mla_decode_bench(MlaDecodeBenchOptions{});
  for (const MlaDecodeBenchResult& r : results) EXPECT_TRUE(std::isfinite(r.us) && r.us > 0.0);
}

// One shape and one kernel (BG_MLA_DECODE, else the default), few replays: what a profiler run (Nsight Compute)
// attaches to. Shape from BG_MLA_DECODE_PROFILE="BATCH,CONTEXT" (default 64,4096).
TEST(MlaDecodeBench, DISABLED_ProfileOne) {
  BG_REQUIRE_GPU();
  MlaDecodeBenchOptions o;
  long long b = 64, ctx = 4096;
  if (const char* v = std::getenv("BG_MLA_DECODE_PROFILE")) {
    ASSERT_EQ(std::sscanf(v, "%lld,%lld", &b, &ctx), 2) << "BG_MLA_DECODE_PROFILE=" << v << " (expected BATCH,CONTEXT)";
  }
  o.cases = {{b, ctx}};
  o.mmas = {mla_decode_mma_from_env()};  // BG_MLA_DECODE, else the default
  o.replays = 1;
  o.rotate_bytes = 0;
  const std::vector<MlaDecodeBenchResult> results = mla_decode_bench(o);
  ASSERT_EQ(results.size(), 1u);
  EXPECT_TRUE(std::isfinite(results[0].us) && results[0].us > 0.0);
}

}  // namespace
}  // namespace bg::ops
