// Batched steps and CUDA-graph decode on the GPU: (1) decode steps replayed from CUDA graphs give the same logits as
// the same steps run eagerly (bit-identical at a bucket-sized batch, within 1e-3 when the batch is padded up to the
// bucket); (2) one mixed step (prefill chunks + decode tokens of several sequences) equals each sequence run alone
// within the bf16 bound; (3) the first step of a freshly loaded model can be a captured graph (no lazy uploads); on
// the golden DeepSeek-V3 and Kimi-K3 tiny models.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "cuda/cuda_testing.h"
#include "golden/golden_util.h"
#include "kv/kda_state_pool.h"
#include "kv/state_manager.h"
#include "model/forward_common.h"
#include "model/model.h"
#include "step_testing.h"

namespace bg::testing {
namespace {

constexpr double kBatchBound = 1e-2;    // mixed batch vs alone: only bf16 GEMM shapes differ
constexpr double kPaddedBound = 1e-3;   // graph at a padded bucket vs eager at the real size

std::unique_ptr<Model> load(const std::string& name, bool graphs) {
  LoadOptions o{.device = "cuda"};
  o.cuda_graphs = graphs;
  return load_model(golden_dir() / name / "model", o);
}

// n sequences prefilled with rotations of the golden tokens, then `steps` greedy decode steps in one batch each.
// Returns every decode step's logits [steps, n, V].
std::vector<float> decode_batch(Model& m, const std::vector<int32_t>& tokens, int64_t n, int64_t steps) {
  const int64_t V = m.info().vocab_size;
  auto state = make_state(m, std::max<int64_t>(8, n), 8192);
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t> p(tokens.begin() + i % 3, tokens.end() - i % 2);
    prompts.push_back(p);
    seqs.push_back(state->new_sequence(static_cast<int64_t>(p.size()) + steps));
  }
  std::vector<BatchEntry> batch;
  for (int64_t i = 0; i < n; ++i) batch.push_back({seqs[static_cast<size_t>(i)].get(), prompts[static_cast<size_t>(i)]});
  std::vector<float> last(static_cast<size_t>(n * V));
  m.forward_batch(batch, last.data());
  std::vector<float> all;
  std::vector<int32_t> next(static_cast<size_t>(n));
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t i = 0; i < n; ++i) {
      next[static_cast<size_t>(i)] = argmax_row(last.data() + i * V, V);
      batch[static_cast<size_t>(i)].tokens = std::span<const int32_t>(&next[static_cast<size_t>(i)], 1);
    }
    m.forward_batch(batch, last.data());
    all.insert(all.end(), last.begin(), last.end());
  }
  return all;
}

double max_row_error(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  double worst = 0.0;
  for (size_t r = 0; r < a.size() / static_cast<size_t>(V); ++r) {
    worst = std::max(worst, row_rel_error(a.data() + r * V, b.data() + r * V, V));
  }
  return worst;
}

class StepGpu : public ::testing::TestWithParam<std::string> {};

TEST_P(StepGpu, GraphDecodeEqualsEagerDecode) {
  BG_REQUIRE_GPU();
  GoldenCase gc(golden_dir() / GetParam());
  const std::vector<int32_t> tokens = gc.prompt(0).tokens;
  auto graphed = load(GetParam(), true);
  auto eager = load(GetParam(), false);
  const int64_t V = graphed->info().vocab_size;
  // 24 is a bucket that is not a power of two; 20 pads up to it.
  for (int64_t n : {1, 4, 3, 6, 24, 20}) {
    std::vector<float> a = decode_batch(*graphed, tokens, n, 5);
    std::vector<float> b = decode_batch(*eager, tokens, n, 5);
    const double err = max_row_error(a, b, V);
    const bool bucket_sized = graph_bucket(n, 64) == n;
    if (bucket_sized) {
      EXPECT_EQ(a, b) << "graph replay differs from eager at batch " << n << " (max rel err " << err << ")";
    } else {
      EXPECT_LE(err, kPaddedBound) << "batch " << n << " padded to a bucket";
    }
    std::printf("[graph] %s batch %ld: graph vs eager max rel err %.3e\n", GetParam().c_str(), static_cast<long>(n),
                err);
  }
  EXPECT_GT(graphed->n_graphs_captured(), 0) << "no CUDA graph was captured";
  EXPECT_EQ(eager->n_graphs_captured(), 0);
}

// A decode graph's padding rows (3 sequences run as a graph of 4) neither read nor write the KDA padding slot: the
// slot, filled with NaN first, keeps its bits through the decode steps, and the real rows' logits stay finite and
// equal the eager steps' within the padded bound. (Models without KDA state: nothing to check.)
TEST_P(StepGpu, PaddingRowsLeaveThePaddingSlotAlone) {
  BG_REQUIRE_GPU();
  GoldenCase gc(golden_dir() / GetParam());
  const std::vector<int32_t> tokens = gc.prompt(0).tokens;
  auto m = load(GetParam(), true);
  auto state = make_state(*m, 4, 4096);
  const KdaStatePool* pool = state->step_pools().state;
  if (pool == nullptr) GTEST_SKIP() << GetParam() << " has no KDA state";
  const int64_t V = m->info().vocab_size;
  auto* pad = static_cast<std::byte*>(pool->storage().data) + pool->pad_slot() * pool->slot_bytes();
  const std::vector<float> poison(static_cast<size_t>(pool->slot_bytes() / 4), std::nanf(""));
  BG_CUDA_CHECK(cudaMemcpy(pad, poison.data(), poison.size() * 4, cudaMemcpyHostToDevice));
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<BatchEntry> batch;
  for (size_t i = 0; i < 3; ++i) {
    seqs.push_back(state->new_sequence(static_cast<int64_t>(tokens.size()) + 4));
    batch.push_back({seqs.back().get(), tokens});
  }
  std::vector<float> logits(static_cast<size_t>(3 * V));
  m->forward_batch(batch, logits.data());  // prefill: eager, no padding
  std::vector<int32_t> next(3);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < 3; ++i) {
      next[i] = argmax_row(logits.data() + static_cast<int64_t>(i) * V, V);
      batch[i].tokens = std::span<const int32_t>(&next[i], 1);
    }
    m->forward_batch(batch, logits.data());  // a graph of bucket 4: one padding row
    ASSERT_TRUE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); })) << step;
  }
  EXPECT_GT(m->n_graphs_captured(), 0);
  std::vector<float> after(poison.size());
  BG_CUDA_CHECK(cudaMemcpy(after.data(), pad, after.size() * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(after.data(), poison.data(), after.size() * 4), 0) << "the padding slot was written";
}

// A decode step's block tables are at least 16k tokens wide (step_table_width), so sequences whose contexts grow
// within that keep replaying the graph their batch bucket captured first: one graph for a short and a long context.
TEST_P(StepGpu, LongerContextsReplayTheSameGraph) {
  BG_REQUIRE_GPU();
  GoldenCase gc(golden_dir() / GetParam());
  const std::vector<int32_t> tokens = gc.prompt(0).tokens;
  auto m = load(GetParam(), true);
  const int64_t V = m->info().vocab_size;
  const int64_t long_len = std::min<int64_t>(1500, m->info().max_position_embeddings - 8);
  auto state = make_state(*m, 2, 4096);
  std::vector<float> logits(static_cast<size_t>(long_len * V));
  int64_t graphs_after_first = -1;
  for (const int64_t len : {int64_t{8}, long_len}) {
    std::vector<int32_t> prompt(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i) prompt[static_cast<size_t>(i)] = tokens[static_cast<size_t>(i) % tokens.size()];
    auto seq = state->new_sequence(len + 2);
    std::vector<BatchEntry> batch{{seq.get(), prompt}};
    m->forward_batch(batch, logits.data());  // prefill: eager
    const int32_t next = argmax_row(logits.data(), V);
    batch[0].tokens = std::span<const int32_t>(&next, 1);
    m->forward_batch(batch, logits.data());  // decode: a graph of bucket 1
    if (graphs_after_first < 0) graphs_after_first = m->n_graphs_captured();
  }
  EXPECT_EQ(graphs_after_first, 1);
  EXPECT_EQ(m->n_graphs_captured(), 1) << "a decode step at a " << long_len << "-token context captured a new graph";
}

// Expert tables (slot maps, descriptor arrays, W4A16 layouts) and every other weight are uploaded at load: the very
// first step a fresh model runs can be a captured decode graph (four one-token prompts: a decode bucket), which an
// upload inside the capture would break (host copies synchronise), and it equals the same step run eagerly.
TEST_P(StepGpu, FirstStepOfAFreshModelIsACapturedGraph) {
  BG_REQUIRE_GPU();
  GoldenCase gc(golden_dir() / GetParam());
  const std::vector<int32_t> tokens = gc.prompt(0).tokens;
  auto first_step = [&](Model& m) {
    const int64_t V = m.info().vocab_size;
    auto state = make_state(m, 4, 64);
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<BatchEntry> batch;
    for (size_t i = 0; i < 4; ++i) {
      seqs.push_back(state->new_sequence(2));
      batch.push_back({seqs.back().get(), std::span<const int32_t>(&tokens[i % tokens.size()], 1)});
    }
    std::vector<float> logits(static_cast<size_t>(4 * V));
    m.forward_batch(batch, logits.data());
    return logits;
  };
  auto graphed = load(GetParam(), true);
  ASSERT_EQ(graphed->n_graphs_captured(), 0);
  const std::vector<float> a = first_step(*graphed);
  EXPECT_EQ(graphed->n_graphs_captured(), 1) << "the first step was not captured";
  auto eager = load(GetParam(), false);
  const std::vector<float> b = first_step(*eager);
  EXPECT_EQ(a, b) << "max rel err " << max_row_error(a, b, graphed->info().vocab_size);
}

TEST_P(StepGpu, MixedBatchEqualsEachSequenceAlone) {
  BG_REQUIRE_GPU();
  GoldenCase gc(golden_dir() / GetParam());
  auto m = load(GetParam(), true);
  const double err = mixed_step_vs_alone(*m, gc.prompt(0).tokens);
  EXPECT_LE(err, kBatchBound);
  std::printf("[batch] %s mixed step vs alone: max rel err %.3e\n", GetParam().c_str(), err);
}

INSTANTIATE_TEST_SUITE_P(Models, StepGpu,
                         ::testing::Values("deepseek_v3/tiny-fp32", "deepseek_v3/tiny-mxfp4", "kimi_k3/k3-tiny"),
                         [](const auto& p) {
                           std::string s = p.param.substr(p.param.find('/') + 1);
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace bg::testing
