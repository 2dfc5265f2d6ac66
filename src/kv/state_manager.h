// kv::StateManager: every byte of sequence state one engine holds, owned in one place (beside the scheduler, not in
// the model). GPU tier: the MLA KV block pool (reference-counted blocks) and the KDA state slot pool (a slot belongs to
// a running sequence or holds a prefix-cache snapshot). Host tier: pages of host memory for offloaded sequences and
// cache entries. Prefix cache: a radix tree over token ids whose nodes share KV blocks with sequences and hold KDA
// snapshots every snapshot_interval tokens. The scheduler reads admission numbers from here, reserves KV here (the
// only place blocks are reserved), and offloads / restores sequences through here; the model only reads the pools a
// step's sequences point to. Single-threaded (the engine's thread). docs/SERVING_ENGINE.md, "Sequence state".
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_set>
#include <vector>

#include "backend/backend.h"
#include "kv/host_tier.h"
#include "kv/kda_state_pool.h"
#include "kv/mla_kv_pool.h"
#include "kv/prefix_cache.h"
#include "kv/sequence.h"
#include "kv/state_codec.h"
#include "kv/state_geometry.h"

namespace bg::kv {

// Sizes and policies of one manager (the planner computes them from the memory budget).
struct StatePlan {
  int64_t kv_block_tokens = 64;
  int64_t kv_blocks = 0;               // GPU KV blocks (besides the padding block)
  int64_t state_slots = 0;             // GPU KDA slots for sequences and snapshots (0 without KDA layers)
  int64_t host_bytes = 0;              // host tier (0: none)
  bool prefix_cache = true;
  int64_t snapshot_interval = 512;     // tokens between KDA snapshots (a multiple of the block size and of 64)
  // Models without KDA layers: a prefix-cache hit is rounded down to a multiple of this (--deterministic sets the
  // snapshot interval, the scheduler's piece grid, so a hit resumes where an uncached prefill would have cut).
  int64_t resume_align_tokens = 1;
  StateCodec state_codec = StateCodec::kF32;  // how offloaded KDA state is stored

  // For tools and tests that run sequences by hand: `max_sequences` slots, KV blocks for `max_tokens` tokens over all
  // of them (plus one partly filled block each), no prefix cache, no host tier.
  static StatePlan simple(int64_t max_sequences, int64_t max_tokens, int64_t block_tokens = 64);
};

// What the tiers hold now and what happened since start (for admission, /metrics and the benchmarks).
struct StateUsage {
  int64_t kv_block_tokens = 0;
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_free = 0;       // free now
  int64_t kv_blocks_cached = 0;     // held only by the prefix cache (evictable)
  int64_t kv_bytes = 0;             // whole GPU pool
  int64_t kv_bytes_used = 0;        // blocks in use (by sequences or the cache)
  int64_t state_slots_total = 0;
  int64_t state_slots_free = 0;
  int64_t state_slots_cached = 0;   // prefix-cache snapshots on the GPU (evictable)
  int64_t state_bytes = 0;          // whole GPU pool
  int64_t state_bytes_used = 0;     // slots in use (by sequences or snapshots)
  int64_t host_bytes_total = 0;
  int64_t host_kv_bytes = 0;        // host pages holding KV blocks
  int64_t host_state_bytes = 0;     // host pages holding KDA state
  int64_t seqs_offloaded = 0;       // sequences in the host tier now
  // counters
  int64_t cache_lookups = 0;        // sequences started with the cache on
  int64_t cache_hits = 0;           // ... that reused at least one token
  int64_t cache_lookup_tokens = 0;  // their input tokens
  int64_t cache_hit_tokens = 0;     // tokens reused (prefill saved)
  int64_t offloads = 0;             // sequences moved to the host tier
  int64_t restores = 0;             // sequences brought back
  int64_t cache_evictions = 0;      // cache blocks and snapshots dropped for room
};

// How a new sequence would start from the cache (see plan_start).
struct StartPlan {
  int64_t resume_tokens = 0;     // tokens taken from the cache (the sequence starts at this position)
  int64_t blocks_needed = 0;     // GPU blocks to allocate for the whole input (restores, copy-on-write, the rest)
  int64_t blocks_pinned = 0;     // evictable cache blocks the sequence would start using
  int64_t slots_needed = 0;      // 1 with KDA layers
};

class StateManager {
 public:
  StateManager(Backend& backend, const StateGeometry& geometry, const StatePlan& plan);
  // Every sequence must be gone (the lifetime rule in kv/sequence.h); waits for copies still in flight.
  ~StateManager();
  StateManager(const StateManager&) = delete;
  StateManager& operator=(const StateManager&) = delete;

  const StateGeometry& geometry() const { return geometry_; }
  const StatePlan& plan() const { return plan_; }
  Backend& backend() const { return backend_; }
  StepPools step_pools() const;
  const MlaKvPool& kv_pool() const { return kv_; }
  // GPU bytes a sequence holds now: its KV blocks (a block shared with the prefix cache counts in full) and its state
  // slot; 0 while it is in the host tier.
  int64_t gpu_bytes_of(const Sequence& seq) const;
  const KdaStatePool& state_pool() const { return state_; }
  bool prefix_cache_on() const { return plan_.prefix_cache; }
  StateUsage usage() const;
  int64_t n_sequences() const { return n_live_; }

  // ---- sequences (state_manager.cpp) ----
  // An empty sequence on the GPU (a zeroed state slot) with KV reserved for `reserve_tokens` tokens. Throws
  // bg::Error when the slot or the blocks cannot be had.
  std::unique_ptr<Sequence> new_sequence(int64_t reserve_tokens = 0);
  // GPU blocks (free + evictable) that reserving [0, n_tokens) for `seq` still needs.
  int64_t blocks_to_reserve(const Sequence& seq, int64_t n_tokens) const;
  // THE place KV is reserved: makes seq's blocks cover positions [0, n_tokens), evicting prefix-cache entries when
  // the pool is short. False (nothing reserved, nothing evicted) when even that would not be enough.
  bool try_reserve(Sequence& seq, int64_t n_tokens);
  void reserve(Sequence& seq, int64_t n_tokens);  // throws instead of returning false
  // Blocks and slots a new sequence could get now: free + evictable cache entries.
  int64_t available_blocks() const;
  int64_t available_slots() const;

  // ---- prefix cache (state_cache.cpp) ----
  // How a sequence for `tokens` would start: the deepest reusable cached prefix (a KDA snapshot position with KDA
  // layers; any position, copy-on-write of a partly used block, without), at most tokens.size() - 1 tokens.
  StartPlan plan_start(std::span<const int32_t> tokens) const;
  // A sequence positioned after the reused prefix, with KV reserved for all of `tokens` (cache off: new_sequence +
  // reserve). Throws bg::Error when the memory plan_start counted is not there.
  std::unique_ptr<Sequence> start_sequence(std::span<const int32_t> tokens);
  // After a step: `tokens` are the sequence's tokens (at least n_past of them), of which the first n_input were its
  // input when it started (prompt, or prompt + generated tokens being recomputed). Inserts what prefill computed
  // into the cache: whole blocks (and the last partial block once the input is done) without KDA layers; with them,
  // the blocks and a state snapshot when the sequence stands at a multiple of the snapshot interval.
  void commit(Sequence& seq, std::span<const int32_t> tokens, int64_t n_input);

  // ---- host tier (state_offload.cpp) ----
  // Moves a GPU sequence to the host tier (copies on the copy stream; its GPU blocks and slot are free at once for
  // later ops). False (nothing changed) when the host tier cannot hold it even after dropping cache entries.
  bool offload(Sequence& seq);
  // GPU blocks + slots restoring `seq` needs.
  int64_t restore_blocks(const Sequence& seq) const;
  // Brings an offloaded sequence back to the GPU (ops issued afterwards see its state). Throws when it does not fit.
  void restore(Sequence& seq);

 private:
  friend class bg::Sequence;
  void release(Sequence& seq);

  // eviction (state_evict.cpp)
  struct EvictScope;
  std::vector<CacheNode*> by_age(const std::function<bool(const CacheNode&)>& pick);
  bool evict_blocks(int64_t n_blocks);
  bool evict_slots(int64_t n_slots);
  bool make_host_room(int64_t n_pages, uint64_t older_than);
  bool host_room_for(int64_t n_pages, uint64_t older_than);
  void drop_node(CacheNode* node);
  void drop_leaf(CacheNode* leaf);
  void prune(CacheNode* node);
  int32_t alloc_block();
  int32_t alloc_slot(bool zero);
  CacheNode* insert_blocks(const Sequence& seq, std::span<const int32_t> tokens, int64_t n_blocks);
  void insert_partial(const Sequence& seq, CacheNode* parent, std::span<const int32_t> tokens);
  void take_snapshot(const Sequence& seq, CacheNode* node);
  void start_state(Sequence& seq, CacheNode* snapshot);
  bool node_evictable_on_gpu(const CacheNode& n) const;
  int64_t resume_point(const PrefixMatch& m, int64_t n_tokens, const CacheNode** node) const;

  // copies (state_offload.cpp)
  std::vector<int32_t> host_alloc(int64_t n_pages, bool state);
  void host_free(std::vector<int32_t>& pages, bool state);
  int64_t slot_pages() const;
  CopyFence slot_to_host(int32_t slot, std::span<const int32_t> pages);
  void slot_from_host(std::span<const int32_t> pages, int32_t slot);
  CopyFence blocks_to_host(std::span<const int32_t> blocks, std::span<const int32_t> pages);
  void blocks_from_host(std::span<const int32_t> pages, std::span<const int32_t> blocks);

  Backend& backend_;
  StateGeometry geometry_;
  StatePlan plan_;
  MlaKvPool kv_;
  KdaStatePool state_;
  HostTier host_;
  PrefixCache cache_;
  std::shared_ptr<std::byte> staging_;  // one slot, for encoding / decoding compressed state
  int64_t n_live_ = 0;
  int64_t host_kv_pages_ = 0;
  int64_t host_state_pages_ = 0;
  int64_t snapshots_on_gpu_ = 0;
  int64_t seqs_offloaded_ = 0;
  CopyFence last_fence_ = 0;  // the latest host-tier copy issued
  StateUsage counters_;
  std::unordered_set<const CacheNode*> dropped_;  // during an eviction
  int evict_depth_ = 0;
};

}  // namespace bg::kv
