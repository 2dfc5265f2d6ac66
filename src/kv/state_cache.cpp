// StateManager, prefix cache: where a new sequence resumes, how it takes the cached blocks and snapshot, what a step
// inserts, and LRU eviction of cache entries (to the host tier when it has room, else dropped).
#include <algorithm>

#include "core/error.h"
#include "kv/state_manager.h"

namespace bg::kv {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What a new sequence takes from the cache: whole blocks (a node each), a block to copy for a partly used last block,
// and the snapshot to start the KDA state from.
struct Resume {
  int64_t tokens = 0;
  std::vector<CacheNode*> whole;
  CacheNode* cow = nullptr;
  CacheNode* snapshot = nullptr;
};

Resume find_resume(const PrefixMatch& m, int64_t n_tokens, bool has_state, int64_t block_tokens,
                   int64_t resume_align) {
  Resume r;
  const int64_t limit = n_tokens - 1;  // at least one token is computed, for its logits
  if (has_state) {
    for (auto it = m.path.rbegin(); it != m.path.rend(); ++it) {
      if ((*it)->has_snapshot() && (*it)->end <= limit) {
        r.snapshot = *it;
        r.tokens = (*it)->end;
        break;
      }
    }
    for (CacheNode* n : m.path) {
      if (n->end <= r.tokens) r.whole.push_back(n);
    }
    return r;
  }
  r.tokens = std::min(m.n_tokens(), limit) / resume_align * resume_align;
  const int64_t n_whole = r.tokens / block_tokens;
  r.whole.assign(m.path.begin(), m.path.begin() + n_whole);
  if (r.tokens % block_tokens != 0) {
    r.cow = n_whole < static_cast<int64_t>(m.path.size()) ? m.path[static_cast<size_t>(n_whole)] : m.partial;
  }
  return r;
}

}  // namespace

bool StateManager::node_evictable_on_gpu(const CacheNode& n) const {
  return n.gpu_block >= 0 && !n.pinned && kv_.refcount(n.gpu_block) == 1;
}

StartPlan StateManager::plan_start(std::span<const int32_t> tokens) const {
  StartPlan p;
  const auto n = static_cast<int64_t>(tokens.size());
  p.slots_needed = geometry_.has_state() ? 1 : 0;
  p.blocks_needed = ceil_div(n, kv_.block_size());
  if (!plan_.prefix_cache || n == 0) return p;
  const Resume r = find_resume(cache_.match(tokens), n, geometry_.has_state(), kv_.block_size(), plan_.resume_align_tokens);
  p.resume_tokens = r.tokens;
  for (const CacheNode* node : r.whole) {
    if (node->gpu_block < 0) continue;  // restored into a new block
    --p.blocks_needed;
    if (kv_.refcount(node->gpu_block) == 1) ++p.blocks_pinned;
  }
  return p;
}

std::unique_ptr<Sequence> StateManager::start_sequence(std::span<const int32_t> tokens) {
  const auto n = static_cast<int64_t>(tokens.size());
  if (!plan_.prefix_cache) {
    std::unique_ptr<Sequence> seq = new_sequence();
    reserve(*seq, n);
    return seq;
  }
  ++counters_.cache_lookups;
  counters_.cache_lookup_tokens += n;
  const Resume r = find_resume(cache_.match(tokens), n, geometry_.has_state(), kv_.block_size(), plan_.resume_align_tokens);
  std::vector<CacheNode*> pinned = r.whole;
  if (r.cow != nullptr) pinned.push_back(r.cow);
  for (CacheNode* node : pinned) node->pinned = true;
  std::unique_ptr<Sequence> seq(new Sequence(this));
  ++n_live_;
  try {
    // Shared blocks first (a reference each), so nothing allocated below can evict them; then host-only blocks come
    // back into new GPU blocks (the node keeps both copies), then the copy-on-write block.
    std::vector<int32_t> blocks(r.whole.size(), -1);
    for (size_t i = 0; i < r.whole.size(); ++i) {
      if (r.whole[i]->gpu_block < 0) continue;
      kv_.ref(r.whole[i]->gpu_block);
      blocks[i] = r.whole[i]->gpu_block;
    }
    std::vector<int32_t> restored_pages, restored_blocks;
    for (size_t i = 0; i < r.whole.size(); ++i) {
      if (blocks[i] >= 0) continue;
      blocks[i] = alloc_block();
      kv_.ref(blocks[i]);
      r.whole[i]->gpu_block = blocks[i];
      restored_pages.push_back(r.whole[i]->host_pages.at(0));
      restored_blocks.push_back(blocks[i]);
    }
    seq->kv_blocks_ = blocks;  // the sequence owns its references from here on
    if (!restored_blocks.empty()) blocks_from_host(restored_pages, restored_blocks);
    if (r.cow != nullptr) {
      const int32_t b = alloc_block();
      seq->kv_blocks_.push_back(b);
      if (r.cow->gpu_block >= 0) {
        kv_.copy_block(r.cow->gpu_block, b);
      } else {
        blocks_from_host(std::span<const int32_t>(&r.cow->host_pages.at(0), 1), std::span<const int32_t>(&b, 1));
      }
    }
    if (geometry_.has_state()) start_state(*seq, r.snapshot);
    seq->n_past_ = seq->n_cached_ = seq->cache_committed_ = r.tokens;
    for (CacheNode* node : pinned) node->pinned = false;
    pinned.clear();
    if (r.cow != nullptr) cache_.touch(r.cow);
    if (!r.whole.empty()) cache_.touch(r.whole.back());
    reserve(*seq, n);
  } catch (...) {
    for (CacheNode* node : pinned) node->pinned = false;
    throw;
  }
  if (r.tokens > 0) ++counters_.cache_hits;
  counters_.cache_hit_tokens += r.tokens;
  return seq;
}

// The new sequence's slot, holding the snapshot's state (zeroed without one). When the snapshot's own GPU slot is the
// only one to be had, the sequence takes it over (the snapshot keeps a host copy when there is room).
void StateManager::start_state(Sequence& seq, CacheNode* snapshot) {
  if (snapshot == nullptr) {
    seq.kda_slot_ = alloc_slot(true);
    return;
  }
  const bool was_pinned = snapshot->pinned;
  snapshot->pinned = true;  // not evicted to make room for its own copy
  const bool slot_free = state_.n_free_slots() > 0 || evict_slots(1);
  snapshot->pinned = was_pinned;
  if (slot_free) {
    seq.kda_slot_ = state_.alloc_slot(false);
    if (snapshot->snap_slot >= 0) {
      state_.copy_slot(snapshot->snap_slot, seq.kda_slot_);
    } else {
      slot_from_host(snapshot->snap_pages, seq.kda_slot_);
    }
    return;
  }
  BG_CHECK(snapshot->snap_slot >= 0, "KDA state pool is full: all {} slots run sequences", state_.n_slots());
  if (snapshot->snap_pages.empty() && host_room_for(slot_pages(), snapshot->last_use)) {
    snapshot->snap_pages = host_alloc(slot_pages(), true);
    backend_.compute_wait(slot_to_host(snapshot->snap_slot, snapshot->snap_pages));
  }
  seq.kda_slot_ = snapshot->snap_slot;
  snapshot->snap_slot = -1;
  --snapshots_on_gpu_;
}

CacheNode* StateManager::insert_blocks(const Sequence& seq, std::span<const int32_t> tokens, int64_t n_blocks) {
  const int64_t B = kv_.block_size();
  CacheNode* at = nullptr;
  for (int64_t i = 0; i < n_blocks; ++i) {
    const auto block = tokens.subspan(static_cast<size_t>(i * B), static_cast<size_t>(B));
    CacheNode* child = cache_.find_child(at, block);
    if (child == nullptr) {
      for (CacheNode* stale : cache_.partial_prefixes(at, block)) {
        if (!stale->pinned) drop_node(stale);
      }
      child = cache_.add_child(at, block);
    }
    if (child->gpu_block < 0) {  // new, or only in the host tier: share the sequence's block
      child->gpu_block = seq.kv_blocks_.at(static_cast<size_t>(i));
      kv_.ref(child->gpu_block);
    }
    at = child;
  }
  if (at != nullptr) cache_.touch(at);
  return at;
}

void StateManager::insert_partial(const Sequence& seq, CacheNode* parent, std::span<const int32_t> tokens) {
  if (CacheNode* covering = cache_.covering_child(parent, tokens)) {
    cache_.touch(covering);
    return;
  }
  for (CacheNode* stale : cache_.partial_prefixes(parent, tokens)) {
    if (!stale->pinned) drop_node(stale);
  }
  CacheNode* leaf = cache_.add_child(parent, tokens);
  const int64_t idx = parent == nullptr ? 0 : parent->end / kv_.block_size();
  leaf->gpu_block = seq.kv_blocks_.at(static_cast<size_t>(idx));
  kv_.ref(leaf->gpu_block);
}

void StateManager::take_snapshot(const Sequence& seq, CacheNode* node) {
  int32_t slot = -1;
  if (state_.n_free_slots() > 0) {
    slot = state_.alloc_slot(false);
  } else if (host_room_for(slot_pages(), node->last_use)) {
    // No GPU slot to spare: the snapshot goes straight to the host tier; later ops must not change the sequence's
    // state before the copy has read it.
    node->snap_pages = host_alloc(slot_pages(), true);
    backend_.compute_wait(slot_to_host(seq.kda_slot_, node->snap_pages));
    return;
  } else if (evict_slots(1)) {
    slot = state_.alloc_slot(false);
  } else {
    return;  // every slot runs a sequence and the host tier is full: no snapshot this time
  }
  state_.copy_slot(seq.kda_slot_, slot);
  node->snap_slot = slot;
  ++snapshots_on_gpu_;
}

void StateManager::commit(Sequence& seq, std::span<const int32_t> tokens, int64_t n_input) {
  if (!plan_.prefix_cache || seq.residency_ != Residency::kGpu) return;
  BG_CHECK(static_cast<int64_t>(tokens.size()) >= seq.n_past_, "commit: {} tokens for a sequence at {}",
           tokens.size(), seq.n_past_);
  const int64_t B = kv_.block_size();
  // Only what prefill computed is shared: those values do not depend on how the input was split into pieces.
  int64_t canon = std::min(seq.n_past_, n_input);
  if (!geometry_.has_state()) {
    // Whole blocks as prefill completes them; the last partial block once the input is done.
    const int64_t target = seq.n_past_ >= n_input ? canon : canon / B * B;
    if (target <= seq.cache_committed_) return;
    CacheNode* at = insert_blocks(seq, tokens, canon / B);
    if (target % B != 0) {
      insert_partial(seq, at, tokens.subspan(static_cast<size_t>(canon / B * B), static_cast<size_t>(canon % B)));
    }
    seq.cache_committed_ = target;
    return;
  }
  // KDA: the state is shared only at a snapshot position the sequence stands on, and the input's last partial chunk
  // (whose rounding depends on where the input ends) is never part of it.
  canon = canon / geometry_.prefill_align_tokens * geometry_.prefill_align_tokens;
  if (canon == 0 || seq.n_past_ != canon || canon % plan_.snapshot_interval != 0 || canon <= seq.cache_committed_) {
    return;
  }
  CacheNode* node = insert_blocks(seq, tokens, canon / B);
  if (!node->has_snapshot()) {
    // Pinned while room is made for its snapshot: evicting other snapshots prunes snapshot-less leaves, and the node
    // is one until its snapshot is taken (ASan caught take_snapshot writing to a node that eviction had freed).
    const bool was_pinned = node->pinned;
    node->pinned = true;
    take_snapshot(seq, node);
    node->pinned = was_pinned;
    // No room for a snapshot: without one the path is not worth keeping (as eviction would have decided).
    if (!node->has_snapshot()) prune(node);
  }
  seq.cache_committed_ = canon;
}

}  // namespace bg::kv
