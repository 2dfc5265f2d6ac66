// Model::set_route_hook (the routing-forced comparison of the GPU golden test) and Model::forward_batch (one step
// over several sequences equals each sequence alone), on the golden DeepSeek-V3 and Kimi-K3 tiny models.
#include <gtest/gtest.h>

#include "model_testing.h"

namespace bg::testing {
namespace {

struct Recorded {
  int64_t layer;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

class ModelSeams : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Model> load() {
    return load_model(golden_dir() / GetParam() / "model", LoadOptions{.max_sequences = 4, .max_total_tokens = 2048});
  }
  std::vector<int32_t> prompt() {
    GoldenCase gc(golden_dir() / GetParam());
    return gc.prompt(0).tokens;  // prompt + continuation: long enough to split
  }
};

TEST_P(ModelSeams, ForcingTheRecordedRoutingReproducesTheRunAndOtherRoutingChangesIt) {
  auto model = load();
  const std::vector<int32_t> p = prompt();
  std::vector<Recorded> recs;
  model->set_route_hook([&](int64_t layer, int64_t, int64_t, std::vector<int32_t>& ids, std::vector<float>& w) {
    recs.push_back({layer, ids, w});
    return false;
  });
  EngineRun plain = run_prefill_then_decode(*model, p, 3);
  ASSERT_FALSE(recs.empty());

  size_t next = 0;
  model->set_route_hook([&](int64_t layer, int64_t, int64_t, std::vector<int32_t>& ids, std::vector<float>& w) {
    EXPECT_EQ(recs.at(next).layer, layer);
    ids = recs.at(next).ids;
    w = recs.at(next).weights;
    ++next;
    return true;
  });
  EngineRun forced = run_prefill_then_decode(*model, p, 3);
  EXPECT_EQ(next, recs.size());
  EXPECT_EQ(forced.tokens, plain.tokens);
  EXPECT_EQ(forced.logits, plain.logits);

  // Every token sent to other experts (same weights): the logits must move.
  const int64_t E = 1 + *std::max_element(recs[0].ids.begin(), recs[0].ids.end());
  model->set_route_hook([&](int64_t, int64_t, int64_t k, std::vector<int32_t>& ids, std::vector<float>&) {
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i % static_cast<size_t>(k)) % E);
    return true;
  });
  auto seq = model->new_sequence();
  const int64_t V = model->info().vocab_size;
  std::vector<float> moved(p.size() * static_cast<size_t>(V));
  model->forward(*seq, p, moved.data());
  double worst = 0.0;
  for (size_t t = 0; t < p.size(); ++t) {
    worst = std::max(worst, row_rel_error(moved.data() + t * V, plain.logits.data() + t * V, V));
  }
  EXPECT_GT(worst, 1e-3);

  model->set_route_hook([](int64_t, int64_t, int64_t, std::vector<int32_t>& ids, std::vector<float>&) {
    ids.pop_back();
    return true;
  });
  auto seq2 = model->new_sequence();
  std::string msg = bg_error_of([&] { model->forward(*seq2, p, moved.data()); });
  EXPECT_NE(msg.find("route hook"), std::string::npos) << msg;
}

TEST_P(ModelSeams, ForwardBatchEqualsEachSequenceAlone) {
  auto model = load();
  const std::vector<int32_t> p = prompt();
  const int64_t V = model->info().vocab_size;
  // Three sequences at different depths: a fresh prompt, a second prefill chunk, and a decode step.
  ASSERT_GT(p.size(), 4u);
  const std::vector<int32_t> head(p.begin(), p.begin() + 3), tail(p.begin() + 3, p.end()), one(1, p[0]);
  const std::vector<std::vector<int32_t>> first{std::vector<int32_t>{}, head, p};
  const std::vector<std::vector<int32_t>> step{p, tail, one};
  auto run = [&](bool batched) {
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<float> scratch;
    for (const auto& f : first) {
      seqs.push_back(model->new_sequence());
      if (!f.empty()) {
        scratch.resize(f.size() * static_cast<size_t>(V));
        model->forward(*seqs.back(), f, scratch.data());
      }
    }
    std::vector<float> last(step.size() * static_cast<size_t>(V));
    if (batched) {
      std::vector<BatchEntry> batch;
      for (size_t i = 0; i < step.size(); ++i) batch.push_back({seqs[i].get(), step[i]});
      model->forward_batch(batch, last.data());
    } else {
      for (size_t i = 0; i < step.size(); ++i) {
        scratch.resize(step[i].size() * static_cast<size_t>(V));
        model->forward(*seqs[i], step[i], scratch.data());
        std::copy(scratch.end() - V, scratch.end(), last.begin() + static_cast<std::ptrdiff_t>(i * V));
      }
    }
    for (size_t i = 0; i < step.size(); ++i) {
      EXPECT_EQ(seqs[i]->n_past(), static_cast<int64_t>(first[i].size() + step[i].size()));
    }
    return last;
  };
  std::vector<float> alone = run(false), together = run(true);
  for (size_t i = 0; i < step.size(); ++i) {
    EXPECT_LE(row_rel_error(together.data() + i * V, alone.data() + i * V, V), 1e-5) << "entry " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ModelSeams, ::testing::Values("deepseek_v3/tiny-fp32", "kimi_k3/k3-tiny"),
                         [](const auto& p) { return p.param.substr(0, p.param.find('/')); });

}  // namespace
}  // namespace bg::testing
