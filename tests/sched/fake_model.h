// A model for scheduler and engine tests: real KV / state pools on the CPU backend (tiny geometry), and logits that
// are a deterministic function of every token the sequence has seen (so a recomputed sequence continues exactly
// like the original). Records each forward_batch's shape; can be told to fail sequences that start with chosen tokens.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "kv/kda_state_pool.h"
#include "kv/mla_kv_pool.h"
#include "model/model.h"

namespace bg::testing {

struct FakeModelOptions {
  int64_t vocab = 64;
  int64_t block_tokens = 4;
  int64_t n_blocks = 64;
  int64_t n_slots = 8;
  int64_t max_positions = 512;
  int64_t eos = 63;
};

class FakeModel final : public Model {
 public:
  explicit FakeModel(const FakeModelOptions& o = {})
      : o_(o),
        backend_(make_backend("cpu")),
        kv_(*backend_, 1, 2, 0, o.block_tokens, o.n_blocks),
        state_(*backend_, KdaStateGeometry{1, 1, 1, 1, 2}, o.n_slots) {
    info_ = {"fake", o.vocab, 8, 1, o.max_positions, 0, o.eos};
  }

  const ModelInfo& info() const override { return info_; }
  std::unique_ptr<Sequence> new_sequence() override { return std::make_unique<Sequence>(&kv_, &state_); }
  MemoryUsage memory_usage() const override {
    return {kv_.block_size(), kv_.n_blocks(), kv_.n_free_blocks(), kv_.bytes(), state_.n_slots(),
            state_.n_free_slots(), state_.bytes()};
  }

  // Row t: logit 5 at h_t % vocab and 2 at (h_t / vocab) % vocab, 0 elsewhere, where h_t hashes every token so far.
  void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn*) override {
    const int64_t n = static_cast<int64_t>(tokens.size());
    BG_CHECK(seq.n_past() + n <= o_.max_positions, "fake: context {} too long", seq.n_past() + n);
    BG_CHECK(seq.n_past() > 0 || n == 0 || poison.count(tokens[0]) == 0, "fake: poisoned first token {}",
             tokens[0]);
    for (int32_t t : tokens) BG_CHECK(t >= 0 && t < o_.vocab, "fake: token {} out of range", t);
    seq.reserve_kv(seq.n_past() + n);
    uint64_t h = seq.n_past() == 0 ? 1469598103934665603ull : hash_[&seq];
    for (int64_t t = 0; t < n; ++t) {
      h = (h ^ static_cast<uint64_t>(tokens[static_cast<size_t>(t)] + 1)) * 1099511628211ull;
      float* row = logits + t * o_.vocab;
      std::fill(row, row + o_.vocab, 0.0f);
      const auto v = static_cast<uint64_t>(o_.vocab);
      row[(h >> 7) % v] = 5.0f;
      row[(h >> 29) % v] += 2.0f;
    }
    hash_[&seq] = h;
    seq.advance(n);
  }

  void forward_batch(std::span<const BatchEntry> batch, float* last_logits) override {
    std::vector<int64_t> shape;
    for (const BatchEntry& e : batch) shape.push_back(static_cast<int64_t>(e.tokens.size()));
    batches.push_back(shape);
    Model::forward_batch(batch, last_logits);
  }

  std::set<int32_t> poison;                   // forward throws for a sequence that starts with one of these
  std::vector<std::vector<int64_t>> batches;  // tokens per entry of every forward_batch call

 private:
  FakeModelOptions o_;
  ModelInfo info_;
  std::unique_ptr<Backend> backend_;
  MlaKvPool kv_;
  KdaStatePool state_;
  std::map<const Sequence*, uint64_t> hash_;
};

}  // namespace bg::testing
