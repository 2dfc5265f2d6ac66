// The mixed-step check shared by the CPU and GPU model tests: three sequences at different depths (a fresh prompt, a
// second prefill chunk, a decode token) run as one Model::forward_batch step and each alone through Model::forward.
#pragma once

#include <algorithm>
#include <memory>
#include <span>
#include <vector>

#include "golden/golden_util.h"
#include "model/model.h"

namespace bg::testing {

// Max relative row error between the batched step's last-token logits and each sequence run alone. tokens: at least
// five ids.
inline double mixed_step_vs_alone(Model& m, const std::vector<int32_t>& p) {
  const int64_t V = m.info().vocab_size;
  const std::vector<int32_t> head(p.begin(), p.begin() + 3), tail(p.begin() + 3, p.end()), one(1, p[0]);
  const std::vector<std::vector<int32_t>> first{std::vector<int32_t>{}, head, p};
  const std::vector<std::vector<int32_t>> step{p, tail, one};
  auto state = make_state(m, 6, 6 * static_cast<int64_t>(p.size() + 1));
  auto run = [&](bool batched) {
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<float> scratch;
    for (const auto& f : first) {
      seqs.push_back(state->new_sequence(static_cast<int64_t>(f.size() + p.size())));
      if (!f.empty()) {
        scratch.resize(f.size() * static_cast<size_t>(V));
        m.forward(*seqs.back(), f, scratch.data());
      }
    }
    std::vector<float> last(step.size() * static_cast<size_t>(V));
    if (batched) {
      std::vector<BatchEntry> batch;
      for (size_t i = 0; i < step.size(); ++i) batch.push_back({seqs[i].get(), step[i]});
      m.forward_batch(batch, last.data());
    } else {
      for (size_t i = 0; i < step.size(); ++i) {
        scratch.resize(step[i].size() * static_cast<size_t>(V));
        m.forward(*seqs[i], step[i], scratch.data());
        std::copy(scratch.end() - V, scratch.end(), last.begin() + static_cast<std::ptrdiff_t>(i * V));
      }
    }
    for (size_t i = 0; i < step.size(); ++i) {
      EXPECT_EQ(seqs[i]->n_past(), static_cast<int64_t>(first[i].size() + step[i].size()));
    }
    return last;
  };
  const std::vector<float> together = run(true), alone = run(false);
  double worst = 0.0;
  for (size_t i = 0; i < step.size(); ++i) {
    worst = std::max(worst, row_rel_error(together.data() + i * V, alone.data() + i * V, V));
  }
  return worst;
}

}  // namespace bg::testing
