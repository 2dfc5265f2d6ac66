// Shared forward steps.
#include "model/forward_common.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <limits>
#include <unordered_set>
#include <utility>

#include "core/env.h"
#include "core/error.h"

namespace bg {

StepPools step_pools_of(std::span<const BatchEntry> batch) {
  BG_CHECK(!batch.empty() && batch[0].seq != nullptr, "forward: a step needs at least one sequence");
  const kv::StateManager& manager = batch[0].seq->manager();
  for (size_t i = 0; i < batch.size(); ++i) {
    const Sequence* seq = batch[i].seq;
    BG_CHECK(seq != nullptr && &seq->manager() == &manager, "forward: entry {} has no sequence or one of another "
             "state manager", i);
    BG_CHECK(seq->residency() == Residency::kGpu, "forward: entry {} is offloaded to the host tier (restore it first)",
             i);
  }
  return manager.step_pools();
}

int64_t step_table_width(int64_t widest, int64_t block_size, int64_t max_positions) {
  const auto pow2 = [](int64_t v) {
    return static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max<int64_t>(v, 1))));
  };
  const int64_t floor = std::min(pow2((kMinTableTokens + block_size - 1) / block_size),
                                 pow2((max_positions + block_size - 1) / block_size));
  return std::max(pow2(widest), floor);
}

StepLayout layout_step(std::span<const BatchEntry> batch, const ModelInfo& info, const StepPools& pools) {
  std::unordered_set<const Sequence*> seen;
  for (size_t i = 0; i < batch.size(); ++i) {
    const BatchEntry& e = batch[i];
    BG_CHECK(e.seq != nullptr && !e.tokens.empty(), "forward: entry {} has no sequence or no tokens", i);
    BG_CHECK(seen.insert(e.seq).second, "forward: entry {} repeats a sequence of this step", i);
    const int64_t end = e.seq->n_past() + static_cast<int64_t>(e.tokens.size());
    BG_CHECK(end <= info.max_position_embeddings, "context of {} tokens exceeds max_position_embeddings {}", end,
             info.max_position_embeddings);
    const auto reserved = static_cast<int64_t>(e.seq->kv_blocks().size()) * pools.kv->block_size();
    BG_CHECK(end <= reserved, "forward: entry {} runs up to position {} but KV is reserved for {} tokens "
             "(kv::StateManager::reserve)", i, end, reserved);
    for (int32_t id : e.tokens) {
      BG_CHECK(id >= 0 && id < info.vocab_size, "token id {} is outside [0, {})", id, info.vocab_size);
    }
  }
  StepLayout s;
  s.seq_begin.push_back(0);
  size_t widest = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const BatchEntry& e = batch[i];
    const int64_t start = e.seq->n_past(), n = static_cast<int64_t>(e.tokens.size());
    widest = std::max(widest, e.seq->kv_blocks().size());
    for (int64_t t = 0; t < n; ++t) {
      s.token_ids.push_back(e.tokens[static_cast<size_t>(t)]);
      s.positions.push_back(start + t);
      s.token_seq.push_back(static_cast<int32_t>(i));
    }
    s.seq_begin.push_back(s.n_tokens());
    s.last_rows.push_back(static_cast<int32_t>(s.n_tokens() - 1));
    if (e.seq->kda_slot() >= 0) s.state_slots.push_back(e.seq->kda_slot());
  }
  BG_CHECK(s.state_slots.empty() || s.state_slots.size() == batch.size(), "forward: sequences of one step must all "
           "have KDA state slots or none");
  s.max_blocks = step_table_width(static_cast<int64_t>(widest), pools.kv->block_size(), info.max_position_embeddings);
  s.block_tables.assign(batch.size() * static_cast<size_t>(s.max_blocks), pools.kv->pad_block());
  for (size_t i = 0; i < batch.size(); ++i) {
    const std::vector<int32_t>& blocks = batch[i].seq->kv_blocks();
    std::copy(blocks.begin(), blocks.end(), s.block_tables.begin() + static_cast<std::ptrdiff_t>(i * s.max_blocks));
  }
  return s;
}

void pad_decode_step(StepLayout& s, int64_t n_seqs, const StepPools& pools) {
  const int32_t pad_block = pools.kv->pad_block(), pad_slot = pools.state != nullptr ? pools.state->pad_slot() : -1;
  BG_CHECK(s.all_single_token() && n_seqs >= s.n_seqs(), "pad_decode_step: {} sequences of {} tokens cannot be padded "
           "to {}", s.n_seqs(), s.n_tokens(), n_seqs);
  // An empty step (a rank without work) gets state slots exactly when the model has KDA state.
  const bool with_state = !s.state_slots.empty() || (s.n_seqs() == 0 && pad_slot >= 0);
  while (s.n_seqs() < n_seqs) {
    s.token_ids.push_back(0);
    s.positions.push_back(0);
    s.token_seq.push_back(static_cast<int32_t>(s.n_seqs()));
    s.last_rows.push_back(static_cast<int32_t>(s.n_tokens() - 1));
    s.seq_begin.push_back(s.n_tokens());
    if (with_state) s.state_slots.push_back(pad_slot);
    s.block_tables.insert(s.block_tables.end(), static_cast<size_t>(s.max_blocks), pad_block);
    ++s.n_padding;
  }
}

int64_t graph_bucket(int64_t n_seqs, int64_t max_batch, bool powers_of_two) {
  if (n_seqs <= 0 || n_seqs > max_batch) return 0;
  const auto pow2 = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(n_seqs)));
  if (powers_of_two || n_seqs <= 16) return pow2;
  // Never past the power of two, which is a multiple of the step here (32 or 64 up to 64 sequences, 128 or 256 up to
  // 256, a multiple of 64 beyond): graph_bucket_test checks it for every n.
  const int64_t step = n_seqs <= 64 ? 8 : (n_seqs <= 256 ? 32 : 64);
  return (n_seqs + step - 1) / step * step;
}

bool graph_buckets_pow2(const char* env_value) {
  return env_choice("BG_GRAPH_BUCKETS", env_value, {"fine", "pow2"}) == 1;
}

int64_t graph_bucket(int64_t n_seqs, int64_t max_batch) {
  static const bool pow2 = graph_buckets_pow2(std::getenv("BG_GRAPH_BUCKETS"));
  return graph_bucket(n_seqs, max_batch, pow2);
}

void finish_step(std::span<const BatchEntry> batch) {
  for (const BatchEntry& e : batch) e.seq->advance(static_cast<int64_t>(e.tokens.size()));
}

void apply_route_hook(Backend& backend, const RouteHook& hook, int64_t layer, Tensor& ids, Tensor& weights) {
  if (!hook) return;
  const int64_t n = ids.rows(), k = ids.cols();
  std::vector<float> ids_f(static_cast<size_t>(n * k));
  std::vector<float> w(static_cast<size_t>(n * k));
  backend.download_f32(ids, ids_f.data());
  backend.download_f32(weights, w.data());
  std::vector<int32_t> id(ids_f.begin(), ids_f.end());
  if (!hook(layer, n, k, id, w)) return;
  BG_CHECK(static_cast<int64_t>(id.size()) == n * k && static_cast<int64_t>(w.size()) == n * k,
           "route hook: layer {} returned {} ids / {} weights for [{}, {}]", layer, id.size(), w.size(), n, k);
  backend.write_bytes(ids, std::as_bytes(std::span<const int32_t>(id)));
  backend.write_bytes(weights, std::as_bytes(std::span<const float>(w)));
}

GroupProjections::GroupProjections(Backend& be, LinearGroup g, Tensor x) : be_(be), g_(std::move(g)), x_(std::move(x)) {
  if (be_.linear_group_fuses(g_, x_.rows())) fused_ = be_.linear_group(g_, x_);
}

Tensor GroupProjections::operator[](size_t i) const {
  BG_CHECK(i < g_.parts.size(), "internal: projection {} of a group of {}", i, g_.parts.size());
  if (!fused_.empty()) return fused_[i];
  Tensor y = be_.act(x_.rows(), g_.parts[i]->n_out());
  be_.linear(*g_.parts[i], x_, y);
  return y;
}

void tap_tensor(Backend& backend, const TapFn* tap, std::string_view name, int64_t layer, const Tensor& t) {
  if (tap == nullptr) return;
  std::vector<float> host(static_cast<size_t>(t.numel()));
  backend.download_f32(t, host.data());
  (*tap)(name, layer, host.data(), t.rows(), t.cols());
}

}  // namespace bg
