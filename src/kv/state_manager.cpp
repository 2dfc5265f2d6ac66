// StateManager: construction, sequences, the one KV reservation site, and what the tiers hold.
#include "kv/state_manager.h"

#include <cstdlib>
#include <numeric>

#include "core/error.h"
#include "core/log.h"

namespace bg::kv {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void validate(const StateGeometry& g, const StatePlan& p) {
  BG_CHECK(g.n_mla_layers > 0 && g.entry_dim() > 0, "state manager: the model has no MLA KV cache");
  BG_CHECK(p.kv_block_tokens >= 1, "KV block size {} must be >= 1", p.kv_block_tokens);
  BG_CHECK(p.resume_align_tokens >= 1, "prefix-cache resume alignment {} must be >= 1", p.resume_align_tokens);
  BG_CHECK(p.kv_blocks >= 0 && p.state_slots >= 0 && p.host_bytes >= 0, "state manager: negative sizes ({} blocks, "
           "{} slots, {} host bytes)", p.kv_blocks, p.state_slots, p.host_bytes);
  if (g.has_state()) {
    BG_CHECK(p.state_slots >= 1, "state manager: a model with KDA layers needs at least one state slot");
    const int64_t unit = std::lcm(p.kv_block_tokens, g.prefill_align_tokens);
    BG_CHECK(p.snapshot_interval >= unit && p.snapshot_interval % unit == 0, "--prefix-snapshot-interval {} must be "
             "a positive multiple of {} (the KV block size {} and the KDA chunk {})", p.snapshot_interval, unit,
             p.kv_block_tokens, g.prefill_align_tokens);
  }
}

}  // namespace

StatePlan StatePlan::simple(int64_t max_sequences, int64_t max_tokens, int64_t block_tokens) {
  StatePlan p;
  p.kv_block_tokens = block_tokens;
  p.kv_blocks = ceil_div(std::max<int64_t>(max_tokens, 1), block_tokens) + std::max<int64_t>(max_sequences, 1);
  p.state_slots = max_sequences;
  p.prefix_cache = false;
  return p;
}

StateManager::StateManager(Backend& backend, const StateGeometry& geometry, const StatePlan& plan)
    : backend_(backend),
      geometry_(geometry),
      plan_((validate(geometry, plan), plan)),
      kv_(backend, geometry, plan.kv_block_tokens, plan.kv_blocks),
      state_(backend, geometry.kda, geometry.has_state() ? plan.state_slots : 0),
      host_(backend, std::max<int64_t>(kv_.block_bytes(), 1),
            plan.host_bytes / std::max<int64_t>(kv_.block_bytes(), 1)),
      cache_(plan.kv_block_tokens) {
  if (geometry_.has_state() && plan_.state_codec != StateCodec::kF32 && host_.n_pages() > 0) {
    staging_ = backend.alloc_host(static_cast<size_t>(state_.slot_bytes()));
  }
}

StateManager::~StateManager() {
  if (n_live_ != 0) {
    // A programming error (docs/ARCHITECTURE.md, "Memory ownership"): those sequences would free into a dead pool.
    log::error("kv::StateManager destroyed while {} sequences still exist", n_live_);
    std::abort();
  }
  backend_.synchronize();
  if (last_fence_ != 0) backend_.wait_fence(last_fence_);  // copies into or out of the host arena may still run
}

StepPools StateManager::step_pools() const {
  return {&kv_, geometry_.has_state() ? &state_ : nullptr};
}

int64_t StateManager::gpu_bytes_of(const Sequence& seq) const {
  if (seq.residency() != Residency::kGpu) return 0;
  const int64_t kv = static_cast<int64_t>(seq.kv_blocks().size()) * kv_.block_bytes();
  return kv + (seq.kda_slot() >= 0 ? state_.slot_bytes() : 0);
}

StateUsage StateManager::usage() const {
  StateUsage u = counters_;
  u.kv_block_tokens = kv_.block_size();
  u.kv_blocks_total = kv_.n_blocks();
  u.kv_blocks_free = kv_.n_free_blocks();
  u.kv_bytes = kv_.bytes();
  u.state_slots_total = state_.n_slots();
  u.state_slots_free = state_.n_free_slots();
  u.state_slots_cached = snapshots_on_gpu_;
  u.state_bytes = state_.bytes();
  u.kv_bytes_used = (kv_.n_blocks() - kv_.n_free_blocks()) * kv_.block_bytes();
  u.state_bytes_used = (state_.n_slots() - state_.n_free_slots()) * state_.slot_bytes();
  u.host_bytes_total = host_.bytes();
  u.host_kv_bytes = host_kv_pages_ * host_.page_bytes();
  u.host_state_bytes = host_state_pages_ * host_.page_bytes();
  u.seqs_offloaded = seqs_offloaded_;
  int64_t cached = 0;
  const_cast<PrefixCache&>(cache_).for_each([&](CacheNode& n) { cached += node_evictable_on_gpu(n) ? 1 : 0; });
  u.kv_blocks_cached = cached;
  return u;
}

int64_t StateManager::available_blocks() const {
  const StateUsage u = usage();
  return u.kv_blocks_free + u.kv_blocks_cached;
}

int64_t StateManager::available_slots() const {
  if (!geometry_.has_state()) return 0;
  return state_.n_free_slots() + snapshots_on_gpu_;
}

int32_t StateManager::alloc_block() {
  if (kv_.n_free_blocks() == 0) evict_blocks(1);
  return kv_.alloc_block();
}

int32_t StateManager::alloc_slot(bool zero) {
  if (state_.n_free_slots() == 0) evict_slots(1);
  return state_.alloc_slot(zero);
}

std::unique_ptr<Sequence> StateManager::new_sequence(int64_t reserve_tokens) {
  std::unique_ptr<Sequence> seq(new Sequence(this));
  ++n_live_;
  if (geometry_.has_state()) seq->kda_slot_ = alloc_slot(true);
  if (reserve_tokens > 0) reserve(*seq, reserve_tokens);
  return seq;
}

void StateManager::release(Sequence& seq) {
  --n_live_;
  for (int32_t b : seq.kv_blocks_) kv_.unref(b);
  seq.kv_blocks_.clear();
  if (seq.kda_slot_ >= 0) state_.free_slot(seq.kda_slot_);
  seq.kda_slot_ = -1;
  if (seq.residency_ == Residency::kHost) --seqs_offloaded_;
  host_free(seq.host_block_pages_, false);
  host_free(seq.host_slot_pages_, true);
}

int64_t StateManager::blocks_to_reserve(const Sequence& seq, int64_t n_tokens) const {
  const int64_t need = ceil_div(n_tokens, kv_.block_size()) - static_cast<int64_t>(seq.kv_blocks_.size());
  return std::max<int64_t>(need, 0);
}

bool StateManager::try_reserve(Sequence& seq, int64_t n_tokens) {
  BG_CHECK(seq.manager_ == this && seq.residency_ == Residency::kGpu, "reserve: the sequence is not on this "
           "manager's GPU tier");
  const int64_t need = blocks_to_reserve(seq, n_tokens);
  if (need == 0) return true;
  if (kv_.n_free_blocks() < need) {
    if (available_blocks() < need) return false;  // evicting would not be enough: leave the cache alone
    if (!evict_blocks(need)) return false;
  }
  for (int64_t i = 0; i < need; ++i) seq.kv_blocks_.push_back(kv_.alloc_block());
  return true;
}

void StateManager::reserve(Sequence& seq, int64_t n_tokens) {
  BG_CHECK(try_reserve(seq, n_tokens), "MLA KV cache is full: {} more blocks of {} tokens are needed for {} tokens, "
           "{} are free and {} held by the prefix cache", blocks_to_reserve(seq, n_tokens), kv_.block_size(),
           n_tokens, kv_.n_free_blocks(), available_blocks() - kv_.n_free_blocks());
}

}  // namespace bg::kv
