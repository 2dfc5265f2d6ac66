// StateManager, eviction: when the GPU pools run short, prefix-cache entries go to the host tier in LRU order (when
// it has room, after dropping older host-only entries) or are dropped; running and offloaded sequences are never
// touched here (the scheduler preempts those).
#include <algorithm>

#include "kv/state_manager.h"

namespace bg::kv {

// Nodes dropped during one eviction (candidate lists hold raw pointers; no node is added while evicting).
struct StateManager::EvictScope {
  explicit EvictScope(StateManager& m) : m_(m) {
    if (m_.evict_depth_++ == 0) m_.dropped_.clear();
  }
  ~EvictScope() { --m_.evict_depth_; }
  StateManager& m_;
};

std::vector<CacheNode*> StateManager::by_age(const std::function<bool(const CacheNode&)>& pick) {
  std::vector<CacheNode*> out;
  cache_.for_each([&](CacheNode& n) {
    if (pick(n)) out.push_back(&n);
  });
  std::sort(out.begin(), out.end(), [](const CacheNode* a, const CacheNode* b) { return a->last_use < b->last_use; });
  return out;
}

void StateManager::drop_node(CacheNode* node) {
  if (node->gpu_block >= 0) kv_.unref(node->gpu_block);
  node->gpu_block = -1;
  host_free(node->host_pages, false);
  if (node->snap_slot >= 0) {
    state_.free_slot(node->snap_slot);
    --snapshots_on_gpu_;
  }
  node->snap_slot = -1;
  host_free(node->snap_pages, true);
  ++counters_.cache_evictions;
  dropped_.insert(node);
  cache_.remove(node);
}

// With KDA layers a node is worth keeping only on the way to a snapshot: leaves without one go, up the path.
void StateManager::prune(CacheNode* node) {
  while (node != nullptr && geometry_.has_state() && node->is_leaf() && !node->has_snapshot() && !node->pinned) {
    CacheNode* parent = node->parent;
    drop_node(node);
    node = parent;
  }
}

void StateManager::drop_leaf(CacheNode* leaf) {
  CacheNode* parent = leaf->parent;
  drop_node(leaf);
  prune(parent);
}

bool StateManager::make_host_room(int64_t n_pages, uint64_t older_than) {
  if (host_.n_pages() < n_pages) return false;
  EvictScope scope(*this);
  for (CacheNode* v : by_age([&](const CacheNode& n) {
         return n.is_leaf() && !n.pinned && n.gpu_block < 0 && n.snap_slot < 0 && n.last_use < older_than;
       })) {
    if (host_.n_free_pages() >= n_pages) break;
    if (dropped_.count(v) == 0) drop_leaf(v);
  }
  return host_.n_free_pages() >= n_pages;
}

bool StateManager::host_room_for(int64_t n_pages, uint64_t older_than) {
  if (host_.n_pages() == 0) return false;
  return host_.n_free_pages() >= n_pages || make_host_room(n_pages - host_.n_free_pages(), older_than);
}

// Frees GPU blocks held only by the cache, oldest first: a block with a host copy is just released, one without gets
// a host copy when there is room, else its node is dropped when it is a leaf (interior nodes wait until their
// subtree is gone, so every remaining node stays reachable).
bool StateManager::evict_blocks(int64_t n_blocks) {
  EvictScope scope(*this);
  bool progress = true;
  while (kv_.n_free_blocks() < n_blocks && progress) {
    progress = false;
    for (CacheNode* c : by_age([&](const CacheNode& n) { return node_evictable_on_gpu(n); })) {
      if (kv_.n_free_blocks() >= n_blocks) break;
      if (dropped_.count(c) != 0 || !node_evictable_on_gpu(*c)) continue;
      if (!c->host_pages.empty()) {
        kv_.unref(c->gpu_block);
        c->gpu_block = -1;
      } else if (host_room_for(1, c->last_use)) {
        c->host_pages = host_alloc(1, false);
        kv_.unref(c->gpu_block, blocks_to_host(std::span<const int32_t>(&c->gpu_block, 1), c->host_pages));
        c->gpu_block = -1;
      } else if (c->is_leaf()) {
        drop_leaf(c);
        progress = true;
        break;  // its parent may be a leaf now, and older than what comes next: scan again in LRU order
      } else {
        continue;
      }
      progress = true;
    }
  }
  return kv_.n_free_blocks() >= n_blocks;
}

// Frees GPU slots holding snapshots, oldest first: to the host tier when it has room, else dropped.
bool StateManager::evict_slots(int64_t n_slots) {
  if (!geometry_.has_state()) return false;
  EvictScope scope(*this);
  for (CacheNode* c : by_age([](const CacheNode& n) { return n.snap_slot >= 0 && !n.pinned; })) {
    if (state_.n_free_slots() >= n_slots) break;
    if (dropped_.count(c) != 0) continue;
    const int32_t slot = c->snap_slot;
    c->snap_slot = -1;
    --snapshots_on_gpu_;
    if (host_room_for(slot_pages(), c->last_use)) {
      c->snap_pages = host_alloc(slot_pages(), true);
      state_.free_slot(slot, slot_to_host(slot, c->snap_pages));
      continue;
    }
    state_.free_slot(slot);
    ++counters_.cache_evictions;
    prune(c);
  }
  return state_.n_free_slots() >= n_slots;
}

}  // namespace bg::kv
