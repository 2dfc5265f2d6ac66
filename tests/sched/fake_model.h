// A model for scheduler, state-manager and engine tests: a CPU backend with a tiny state geometry, and logits that are
// a deterministic function of every token the sequence has seen. The running hash lives in the sequence's state, as
// a real model's context does: after each token in its KV entry, after each step in its KDA slot, so prefix-cache
// hits, snapshots and host-tier round trips carry it (and a forward checks that the slot and the KV agree). Records
// each forward_batch's shape; can be told to fail sequences that start with chosen tokens.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "kv/state_manager.h"
#include "model/model.h"

namespace bg::testing {

struct FakeModelOptions {
  int64_t vocab = 64;
  int64_t block_tokens = 4;
  int64_t n_blocks = 64;
  int64_t n_slots = 8;
  int64_t max_positions = 512;
  int64_t eos = 63;
  int64_t prefill_align = 1;      // StateGeometry::prefill_align_tokens
  bool prefix_cache = false;
  int64_t snapshot_interval = 256;  // prefill pieces never cross a multiple of it (with state)
  int64_t host_bytes = 0;
  bool with_state = true;         // false: no KDA slots (like DeepSeek-V3)
  int64_t resume_align = 1;       // kv::StatePlan::resume_align_tokens

  kv::StatePlan state_plan() const {
    kv::StatePlan p;
    p.kv_block_tokens = block_tokens;
    p.kv_blocks = n_blocks;
    p.state_slots = with_state ? n_slots : 0;
    p.host_bytes = host_bytes;
    p.prefix_cache = prefix_cache;
    p.snapshot_interval = snapshot_interval;
    p.resume_align_tokens = resume_align;
    return p;
  }
};

class FakeModel final : public Model {
 public:
  explicit FakeModel(const FakeModelOptions& o = {}) : o_(o), backend_(make_backend("cpu")) {
    info_ = {"fake", o.vocab, 8, 1, o.max_positions, 0, o.eos};
    // One MLA layer of 2 floats per token (the 64-bit hash); one KDA layer whose slot starts with the hash.
    geometry_.n_mla_layers = 1;
    geometry_.kv_lora_rank = 2;
    if (o.with_state) geometry_.kda = KdaStateGeometry{1, 1, 2, 2, 2};
    geometry_.prefill_align_tokens = o.prefill_align;
  }

  const ModelInfo& info() const override { return info_; }
  const StateGeometry& state_geometry() const override { return geometry_; }
  Backend& backend() const override { return *backend_; }

  // Row t: logit 5 at h_t % vocab and 2 at (h_t / vocab) % vocab, 0 elsewhere, where h_t hashes every token so far.
  void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* = nullptr) override {
    const int64_t n = static_cast<int64_t>(tokens.size()), p0 = seq.n_past();
    BG_CHECK(seq.residency() == Residency::kGpu, "fake: the sequence is offloaded");
    BG_CHECK(p0 + n <= o_.max_positions, "fake: context {} too long", p0 + n);
    BG_CHECK(p0 + n <= static_cast<int64_t>(seq.kv_blocks().size()) * o_.block_tokens, "fake: KV not reserved for "
             "{} tokens", p0 + n);
    BG_CHECK(p0 > 0 || n == 0 || poison.count(tokens[0]) == 0, "fake: poisoned first token {}", tokens[0]);
    for (int32_t t : tokens) BG_CHECK(t >= 0 && t < o_.vocab, "fake: token {} out of range", t);
    uint64_t h = p0 == 0 ? 1469598103934665603ull : load(entry(seq, p0 - 1));
    if (seq.kda_slot() >= 0 && p0 > 0) {
      BG_CHECK(load(slot(seq)) == h, "fake: the state slot disagrees with the KV cache at position {}", p0);
    }
    for (int64_t t = 0; t < n; ++t) {
      h = (h ^ static_cast<uint64_t>(tokens[static_cast<size_t>(t)] + 1)) * 1099511628211ull;
      store(entry(seq, p0 + t), h);
      float* row = logits + t * o_.vocab;
      std::fill(row, row + o_.vocab, 0.0f);
      const auto v = static_cast<uint64_t>(o_.vocab);
      row[(h >> 7) % v] = 5.0f;
      row[(h >> 29) % v] += 2.0f;
    }
    if (seq.kda_slot() >= 0) store(slot(seq), h);
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
  static uint64_t load(const float* p) {
    uint64_t h = 0;
    std::memcpy(&h, p, sizeof(h));
    return h;
  }
  static void store(float* p, uint64_t h) { std::memcpy(p, &h, sizeof(h)); }
  float* entry(const Sequence& seq, int64_t pos) const {
    const MlaKvPool& kv = *seq.pools().kv;
    const int32_t block = seq.kv_blocks().at(static_cast<size_t>(pos / o_.block_tokens));
    return kv.storage().as<float>() + (block * o_.block_tokens + pos % o_.block_tokens) * 2;
  }
  float* slot(const Sequence& seq) const {
    return seq.pools().state->storage().as<float>() + seq.kda_slot() * (seq.pools().state->slot_bytes() / 4);
  }

  FakeModelOptions o_;
  ModelInfo info_;
  StateGeometry geometry_;
  std::unique_ptr<Backend> backend_;
};

// A fake model and the state manager its sequences live in, declared in that order (the lifetime rule).
struct FakeSetup {
  explicit FakeSetup(const FakeModelOptions& o = {})
      : model(o), state(model.backend(), model.state_geometry(), o.state_plan()) {}
  FakeModel model;
  kv::StateManager state;
};

}  // namespace bg::testing
