// Resident and streamed experts on the CPU backend: residency planning (fraction, routing trace), the trace file's
// validation, and the MoE layer with a fraction of its experts streamed through a shared pool giving bit-identical
// outputs to the all-resident layer, with the copies and buffer hits the pool reports, and the next layer's experts
// prefetched while a layer runs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "error_testing.h"
#include "moe/expert_stream.h"
#include "moe/moe_layer.h"
#include "moe/moe_testing.h"

namespace bg::moe {
namespace {

namespace fs = std::filesystem;

using testing::error_of;

fs::path write_file(const std::string& name, const std::string& text) {
  const fs::path p = fs::temp_directory_path() / (std::to_string(::getpid()) + "-" + name);
  std::ofstream(p) << text;
  return p;
}

std::vector<int32_t> resident_of(const ExpertResidency& r, const ExpertPlacement& p, int64_t layer) {
  std::vector<int32_t> out;
  for (int32_t e : p.experts_of(p.rank())) {
    if (r.resident(layer, e)) out.push_back(e);
  }
  return out;
}

TEST(ExpertResidency, FractionPicksExpertOrderAndTheTracePicksTheMostRouted) {
  const ExpertPlacement p = ExpertPlacement::contiguous(8, 2, 1);  // experts 4..7 here
  EXPECT_FALSE(ExpertResidency::plan(p, 1.0).streaming());
  const ExpertResidency half = ExpertResidency::plan(p, 0.5);
  EXPECT_TRUE(half.streaming());
  EXPECT_EQ(half.n_resident_per_layer(), 2);
  EXPECT_EQ(half.n_streamed_per_layer(), 2);
  EXPECT_EQ(resident_of(half, p, 3), (std::vector<int32_t>{4, 5}));
  EXPECT_TRUE(half.resident(3, 0)) << "another rank's expert is never streamed here";
  EXPECT_TRUE(resident_of(ExpertResidency::plan(p, 0.0), p, 0).empty());
  EXPECT_FALSE(ExpertResidency::plan(p, 0.9).streaming()) << "0.9 of 4 rounds to all 4";

  std::map<int64_t, std::vector<uint64_t>> counts{{3, {9, 9, 9, 9, 1, 7, 0, 7}}};
  const fs::path trace = fs::temp_directory_path() / (std::to_string(::getpid()) + "-trace.json");
  write_expert_trace(trace, 8, counts);
  EXPECT_EQ(read_expert_trace(trace, 8), counts);
  const ExpertResidency traced = ExpertResidency::plan(p, 0.5, trace);
  EXPECT_EQ(resident_of(traced, p, 3), (std::vector<int32_t>{5, 7})) << "the most routed; ties by id";
  EXPECT_EQ(resident_of(traced, p, 1), (std::vector<int32_t>{4, 5})) << "a layer the trace lacks: expert order";
  fs::remove(trace);
}

TEST(ExpertResidency, BadFractionsAndTracesAreClearErrors) {
  const ExpertPlacement p = ExpertPlacement::contiguous(4, 1, 0);
  EXPECT_NE(error_of([&] { ExpertResidency::plan(p, 1.5); }).find("--resident-experts"), std::string::npos);
  EXPECT_NE(error_of([&] { ExpertResidency::plan(p, -0.1); }).find("[0, 1]"), std::string::npos);
  struct Bad {
    std::string text, message;
  };
  const std::vector<Bad> bad = {
      {R"({"format": "other", "version": 1, "n_experts": 4, "layers": []})", "format"},
      {R"({"format": "batchgen-expert-trace", "version": 2, "n_experts": 4, "layers": []})", "version 2"},
      {R"({"format": "batchgen-expert-trace", "version": 1, "n_experts": 8, "layers": []})", "8 experts"},
      {R"({"format": "batchgen-expert-trace", "version": 1, "n_experts": 4})", "\"layers\""},
      {R"({"format": "batchgen-expert-trace", "version": 1, "n_experts": 4, "layers": [{"layer": 0, "counts": [1, 2]}]})",
       "4 integers"},
      {R"({"format": "batchgen-expert-trace", "version": 1, "n_experts": 4, "layers": [{"layer": 0, "counts": [1, -2, 3, 4]}]})",
       "non-negative"},
      {R"({"format": "batchgen-expert-trace", "version": 1, "n_experts": 4, "layers": [{"layer": 0, "counts": [1, 2, 3, 4]}, {"layer": 0, "counts": [1, 2, 3, 4]}]})",
       "repeated"},
      {R"([1, 2])", "trace"},
      {R"({"format": )", "trace"},
  };
  for (const Bad& b : bad) {
    const fs::path f = write_file("bad-trace.json", b.text);
    const std::string e = error_of([&] { ExpertResidency::plan(p, 0.5, f); });
    EXPECT_FALSE(e.empty()) << b.text;
    EXPECT_TRUE(e.find(b.message) != std::string::npos || e.find(f.string()) != std::string::npos)
        << b.text << " -> " << e;
    fs::remove(f);
  }
}

// Random MXFP4 experts as a checkpoint would hold them (the test owns the bytes), prepared on the backend.
struct Mxfp4Experts {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<QuantWeight> weights;  // [3 * expert + {gate, up, down}]
  std::vector<std::unique_ptr<LinearHandle>> handles;
  Mxfp4Experts(Backend& be, int64_t n_experts, int64_t hidden, int64_t inter, uint64_t seed) {
    std::mt19937_64 rng(seed);
    auto make = [&](int64_t out, int64_t in) {
      QuantWeight w;
      w.format = WeightFormat::kMxfp4;
      w.n_out = out;
      w.n_in = in;
      storage.emplace_back(static_cast<size_t>(out * in / 2));
      for (uint8_t& b : storage.back()) b = static_cast<uint8_t>(rng());
      w.data = {DType::kU8, {out, in / 2}, reinterpret_cast<const std::byte*>(storage.back().data()),
                storage.back().size(), "expert.weight"};
      storage.emplace_back(static_cast<size_t>(out * in / 32));
      for (uint8_t& b : storage.back()) b = static_cast<uint8_t>(120 + rng() % 8);  // scales near 2^-7..2^0
      w.scale = {DType::kU8, {out, in / 32}, reinterpret_cast<const std::byte*>(storage.back().data()),
                 storage.back().size(), "expert.weight_scale"};
      weights.push_back(w);
    };
    storage.reserve(static_cast<size_t>(6 * n_experts));
    for (int64_t e = 0; e < n_experts; ++e) {
      make(inter, hidden);
      make(inter, hidden);
      make(hidden, inter);
    }
    for (const QuantWeight& w : weights) handles.push_back(be.prepare_linear(w));
  }
  ExpertSource source(int32_t e) const {
    const auto i = static_cast<size_t>(3 * e);
    return {weights[i], weights[i + 1], weights[i + 2]};
  }
  // Resident handles by global id (null where `streamed` or another rank holds the expert).
  ExpertWeights resident(const ExpertPlacement& p, const std::vector<int32_t>& streamed) const {
    ExpertWeights w;
    for (int32_t e = 0; e < static_cast<int32_t>(handles.size() / 3); ++e) {
      const bool here = p.owner(e) == p.rank() && std::find(streamed.begin(), streamed.end(), e) == streamed.end();
      const auto i = static_cast<size_t>(3 * e);
      w.gate.push_back(here ? handles[i].get() : nullptr);
      w.up.push_back(here ? handles[i + 1].get() : nullptr);
      w.down.push_back(here ? handles[i + 2].get() : nullptr);
    }
    return w;
  }
};

// The regions pinned for the copies: whole pages, merged where they touch (a page is registered once).
TEST(ExpertStream, PinnedRegionsAreWholePagesMergedWhereTheyTouch) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<std::byte> memory(8 * page + page);
  auto* base = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(memory.data()) + page - 1) / page * page);
  const std::vector<HostRegion> got = page_aligned_regions({
      {base + 5 * page + 10, 20},        // inside page 5
      {base + 10, page},                 // pages 0-1
      {base + 2 * page - 1, 2},          // pages 1-2: touches the range above
      {base + 7 * page, 0},              // empty: dropped
      {base + 5 * page + 100, page},     // pages 5-6: overlaps the first
  });
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].data, base);
  EXPECT_EQ(got[0].bytes, 3 * page);
  EXPECT_EQ(got[1].data, base + 5 * page);
  EXPECT_EQ(got[1].bytes, 2 * page);
  EXPECT_TRUE(page_aligned_regions({}).empty());
}

using Call = std::tuple<std::vector<int32_t>, std::vector<float>, std::vector<float>>;  // ids, weights, x

constexpr int64_t kE = 12, kTopK = 3, kHidden = 64, kInter = 32;

// `layers` MoE layers (their experts in `experts`) with `fraction` of each resident run every call in order; the
// streamed ones share a pool of `n_buffers` (0: ExpertStream::pool_buffers). Returns every layer's outputs, in order.
std::vector<float> run_layers(Backend& be, const std::vector<std::unique_ptr<Mxfp4Experts>>& experts,
                              const std::vector<Call>& calls, double fraction, ExpertStream::Stats* stats,
                              int64_t n_buffers = 0, bool prefetch = true) {
  const ExpertPlacement p = ExpertPlacement::contiguous(kE, 1, 0);
  const ExpertResidency r = ExpertResidency::plan(p, fraction);
  if (n_buffers == 0) n_buffers = ExpertStream::pool_buffers(r.n_streamed_per_layer());
  std::unique_ptr<ExpertStream> stream;
  std::vector<MoeLayerWeights> layers(experts.size());
  for (size_t l = 0; l < experts.size(); ++l) {
    const Mxfp4Experts& ex = *experts[l];
    StreamedExperts s;
    std::vector<int32_t> streamed;
    for (int32_t e = 0; e < kE; ++e) {
      if (!r.resident(static_cast<int64_t>(l), e)) {
        s.sources.emplace(e, ex.source(e));
        streamed.push_back(e);
      }
    }
    if (!streamed.empty()) {
      if (!stream) stream = std::make_unique<ExpertStream>(be, n_buffers, ex.source(0), kE, prefetch);
      s.stream = stream.get();
      s.layer = static_cast<int64_t>(l);
    }
    layers[l].experts = ExpertTable(be, p, ex.resident(p, streamed), std::move(s));
    EXPECT_EQ(layers[l].experts.streams(), fraction < 1.0);
  }
  std::vector<float> all;
  for (const auto& [ids, wts, x] : calls) {
    const auto n = static_cast<int64_t>(x.size()) / kHidden;
    const MoeLayerSpec spec{{n, kE, kTopK, 1, 1, true, 1.0f}, {GluKind::kSwiGlu, 1.0f, 0.0f}};
    MoeChoice choice{upload_i32(be, ids, {n, kTopK}), be.upload_f32(wts, {n, kTopK}, DType::kF32)};
    const Tensor xt = be.upload_f32(x, {n, kHidden}, DType::kF32);
    for (MoeLayerWeights& w : layers) {
      Tensor out = be.zeros({n, kHidden}, DType::kF32);
      auto exchange = make_loopback_exchange();
      moe_routed(be, *exchange, spec, w, choice, xt, out, {});
      const std::vector<float> v = download(be, out);
      all.insert(all.end(), v.begin(), v.end());
    }
  }
  if (stats != nullptr && stream) *stats = stream->stats();
  return all;
}

// `n` tokens, each routed to kTopK of the first `n_used` even experts.
Call random_call(std::mt19937_64& rng, int64_t n, int32_t n_used) {
  std::vector<int32_t> ids;
  std::vector<float> wts, x(static_cast<size_t>(n * kHidden));
  for (int64_t t = 0; t < n; ++t) {
    std::vector<int32_t> pool(static_cast<size_t>(n_used));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int64_t j = 0; j < kTopK; ++j) {
      ids.push_back(pool[static_cast<size_t>(j)] * 2 % static_cast<int32_t>(kE));  // even experts only
      wts.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(rng));
    }
  }
  for (float& f : x) f = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  return {ids, wts, x};
}

std::vector<std::unique_ptr<Mxfp4Experts>> make_layers(Backend& be, int64_t n_layers) {
  std::vector<std::unique_ptr<Mxfp4Experts>> experts;
  for (int64_t l = 0; l < n_layers; ++l) {
    experts.push_back(std::make_unique<Mxfp4Experts>(be, kE, kHidden, kInter, 10 + static_cast<uint64_t>(l)));
  }
  return experts;
}

// Three MoE layers of 12 experts share one pool; tokens routed over a few experts per call, a call repeated: the
// outputs equal the all-resident layers bit for bit whatever the fraction, every streamed expert is copied when it
// is first needed, and a repeated call finds what the previous one left in the pool.
TEST(ExpertStream, StreamedLayersEqualResidentOnesBitForBit) {
  auto be = make_backend("cpu");
  const auto experts = make_layers(*be, 3);
  std::mt19937_64 rng(7);
  // (tokens, distinct experts to draw from) per call; the last call repeats the first.
  std::vector<Call> calls;
  for (auto [n, used] : {std::pair<int64_t, int32_t>{5, 4}, {9, 6}, {1, 3}}) calls.push_back(random_call(rng, n, used));
  calls.insert(calls.begin() + 1, calls.front());  // repeated at once: everything it needs is still in the pool
  calls.push_back(calls.front());
  const std::vector<float> resident = run_layers(*be, experts, calls, 1.0, nullptr);
  for (float v : resident) ASSERT_TRUE(std::isfinite(v));
  ExpertStream::Stats none, half;
  EXPECT_EQ(run_layers(*be, experts, calls, 0.0, &none), resident);
  EXPECT_EQ(run_layers(*be, experts, calls, 0.5, &half), resident);
  // Fraction 0: every used (even) expert streams; the pool is shared, so the first call's experts are still there
  // when it repeats: hits, and fewer copies than routed experts.
  EXPECT_GT(none.copies, 0u);
  EXPECT_GT(none.hits, 0u);
  EXPECT_EQ(none.bytes_copied, none.copies * 3 * (kInter * kHidden / 2 + kInter * kHidden / 32));
  // Fraction 0.5: experts 0..5 resident, so only 6, 8, 10 can stream.
  EXPECT_GT(half.copies, 0u);
  EXPECT_LT(half.copies, none.copies);
}

// A pool of two layers' worth under three layers that each route the same six experts every call: without prefetch
// the least recently used buffer is always the one the next layer needs (no hit at all); with it, once the order of
// the layers is known (after the first call), each layer's experts are copied while the layer before it runs and
// every later stage finds them there. The outputs are the resident ones either way.
TEST(ExpertStream, TheNextLayersExpertsArePrefetched) {
  auto be = make_backend("cpu");
  const auto experts = make_layers(*be, 3);
  std::mt19937_64 rng(9);
  Call call = random_call(rng, 24, 6);  // 24 tokens over the six even experts: each one routed
  const std::vector<Call> calls(3, call);
  const std::vector<float> resident = run_layers(*be, experts, calls, 1.0, nullptr);
  ExpertStream::Stats off, on;
  EXPECT_EQ(run_layers(*be, experts, calls, 0.0, &off, 12, false), resident);
  EXPECT_EQ(run_layers(*be, experts, calls, 0.0, &on, 12, true), resident);
  EXPECT_EQ(off.hits, 0u);
  EXPECT_EQ(off.copies, 54u);  // 3 calls x 3 layers x 6 experts
  EXPECT_EQ(off.prefetches, 0u);
  // Call 1 learns the order (18 copies); call 2: layer 0 misses (its buffers went to layer 2), then layers 1 and 2
  // and the next call's layer 0 are prefetched; call 3: every layer a prefetch hit.
  EXPECT_EQ(on.prefetch_hits, 30u);
  EXPECT_EQ(on.hits, 30u);
  // Copies: the stages' misses plus every prefetch, the last one (a fourth call's layer 0) never used.
  EXPECT_EQ(on.prefetches, 36u);
  EXPECT_EQ(on.copies, (off.copies - on.hits) + on.prefetches);
}

}  // namespace
}  // namespace bg::moe
