// Model::set_route_hook (the routing-forced comparison of the GPU golden test) and Model::forward_batch (one step
// over several sequences equals each sequence alone), on the golden DeepSeek-V3 and Kimi-K3 tiny models.
#include <gtest/gtest.h>

#include "model_testing.h"
#include "step_testing.h"

namespace bg::testing {
namespace {

class ModelSeams : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Model> load() {
    return load_model(golden_dir() / GetParam() / "model");
  }
  std::vector<int32_t> prompt() {
    GoldenCase gc(golden_dir() / GetParam());
    return gc.prompt(0).tokens;  // prompt + continuation: long enough to split
  }
};

TEST_P(ModelSeams, ForcingTheRecordedRoutingReproducesTheRunAndOtherRoutingChangesIt) {
  auto model = load();
  const std::vector<int32_t> p = prompt();
  RoutingTape tape;
  model->set_route_hook(tape.recorder());
  EngineRun plain = run_prefill_then_decode(*model, p, 3);
  const std::vector<RoutingTape::Record>& recs = tape.records;
  ASSERT_FALSE(recs.empty());

  model->set_route_hook(tape.replayer());
  EngineRun forced = run_prefill_then_decode(*model, p, 3);
  EXPECT_EQ(tape.next, recs.size());
  EXPECT_EQ(forced.tokens, plain.tokens);
  EXPECT_EQ(forced.logits, plain.logits);

  // Every token sent to other experts (same weights): the logits must move.
  const int64_t E = 1 + *std::max_element(recs[0].ids.begin(), recs[0].ids.end());
  model->set_route_hook([&](int64_t, int64_t, int64_t k, std::vector<int32_t>& ids, std::vector<float>&) {
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i % static_cast<size_t>(k)) % E);
    return true;
  });
  auto state = make_state(*model, 2, 2 * static_cast<int64_t>(p.size()));
  auto seq = state->new_sequence(static_cast<int64_t>(p.size()));
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
  auto seq2 = state->new_sequence(static_cast<int64_t>(p.size()));
  std::string msg = bg_error_of([&] { model->forward(*seq2, p, moved.data()); });
  EXPECT_NE(msg.find("route hook"), std::string::npos) << msg;
}

TEST_P(ModelSeams, ForwardBatchEqualsEachSequenceAlone) {
  auto model = load();
  const std::vector<int32_t> p = prompt();
  ASSERT_GT(p.size(), 4u);
  EXPECT_LE(mixed_step_vs_alone(*model, p), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Models, ModelSeams, ::testing::Values("deepseek_v3/tiny-fp32", "kimi_k3/k3-tiny"),
                         [](const auto& p) { return p.param.substr(0, p.param.find('/')); });

}  // namespace
}  // namespace bg::testing
