// The prefix cache's radix tree over token ids, one node per KV block: a node holds block_size tokens (fewer for a
// partial leaf), the position after them, where its KV block lives (a GPU block the tree holds a reference on, host
// pages, or both) and, for Kimi-K3, a snapshot of the KDA/conv state after its last token. Structure and LRU order
// only: the kv::StateManager moves the memory. Invariant: every node's block lives on the GPU or in the host tier
// (a node whose block is dropped is removed with its subtree).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace bg::kv {

struct CacheNode {
  CacheNode* parent = nullptr;
  std::vector<int32_t> tokens;      // positions [end - tokens.size(), end)
  int64_t end = 0;
  int32_t gpu_block = -1;           // the tree's reference on a GPU block, or -1
  std::vector<int32_t> host_pages;  // the block's copy in the host tier (one page), or empty
  int32_t snap_slot = -1;           // KDA state after `end` tokens in a GPU state slot, or -1
  std::vector<int32_t> snap_pages;  // ... or in host pages (encoded with the manager's codec)
  uint64_t last_use = 0;
  bool pinned = false;              // being taken by a starting sequence: not evictable
  std::vector<std::unique_ptr<CacheNode>> children;

  bool has_snapshot() const { return snap_slot >= 0 || !snap_pages.empty(); }
  bool is_leaf() const { return children.empty(); }
};

// The longest cached prefix of a token list: whole nodes, then optionally the first `partial_tokens` tokens of one
// more node (a partial leaf, or a block whose later tokens differ).
struct PrefixMatch {
  std::vector<CacheNode*> path;     // whole nodes, root child first
  CacheNode* partial = nullptr;
  int64_t partial_tokens = 0;
  int64_t n_tokens() const;
};

class PrefixCache {
 public:
  explicit PrefixCache(int64_t block_tokens);

  int64_t block_tokens() const { return block_tokens_; }
  int64_t n_nodes() const { return n_nodes_; }
  PrefixMatch match(std::span<const int32_t> tokens) const;
  // The child of `parent` (nullptr: the root) holding exactly `tokens`, or nullptr.
  CacheNode* find_child(CacheNode* parent, std::span<const int32_t> tokens) const;
  // Adds a child with `tokens` (no payload yet). A full block replaces nothing; the caller removes dominated partial
  // siblings with remove() after releasing their payload.
  CacheNode* add_child(CacheNode* parent, std::span<const int32_t> tokens);
  // A child of `parent` whose tokens start with `tokens` (a whole block or a longer partial leaf), or nullptr.
  CacheNode* covering_child(CacheNode* parent, std::span<const int32_t> tokens) const;
  // Partial leaves under `parent` whose tokens are a prefix of `tokens` (superseded once `tokens` is cached).
  std::vector<CacheNode*> partial_prefixes(CacheNode* parent, std::span<const int32_t> tokens) const;
  // Marks a path (and its ancestors) as used now.
  void touch(CacheNode* node);
  // Removes a leaf (its payload must already be released).
  void remove(CacheNode* leaf);
  // Every node, parents before children.
  void for_each(const std::function<void(CacheNode&)>& fn);

 private:
  std::vector<std::unique_ptr<CacheNode>>& children_of(CacheNode* parent) const;
  int64_t block_tokens_;
  mutable std::unique_ptr<CacheNode> root_;
  uint64_t clock_ = 0;
  int64_t n_nodes_ = 0;
};

}  // namespace bg::kv
