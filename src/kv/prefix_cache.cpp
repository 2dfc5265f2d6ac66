// PrefixCache: radix-tree matching, insertion and removal over block-sized nodes.
#include "kv/prefix_cache.h"

#include <algorithm>

#include "core/error.h"

namespace bg::kv {
namespace {

int64_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

}  // namespace

int64_t PrefixMatch::n_tokens() const {
  const int64_t whole = path.empty() ? 0 : path.back()->end;
  return whole + partial_tokens;
}

PrefixCache::PrefixCache(int64_t block_tokens) : block_tokens_(block_tokens), root_(std::make_unique<CacheNode>()) {
  BG_CHECK(block_tokens >= 1, "prefix cache: block size {} must be >= 1", block_tokens);
}

std::vector<std::unique_ptr<CacheNode>>& PrefixCache::children_of(CacheNode* parent) const {
  return parent == nullptr ? root_->children : parent->children;
}

PrefixMatch PrefixCache::match(std::span<const int32_t> tokens) const {
  PrefixMatch m;
  CacheNode* at = nullptr;
  int64_t pos = 0;
  while (pos < static_cast<int64_t>(tokens.size())) {
    const auto rest = tokens.subspan(static_cast<size_t>(pos));
    const auto block = rest.subspan(0, std::min<size_t>(rest.size(), static_cast<size_t>(block_tokens_)));
    CacheNode* whole = nullptr;
    CacheNode* best = nullptr;
    int64_t best_len = 0;
    for (const auto& c : children_of(at)) {
      const int64_t len = common_prefix(c->tokens, block);
      if (len == block_tokens_ && static_cast<int64_t>(c->tokens.size()) == block_tokens_) whole = c.get();
      if (len > best_len) {
        best = c.get();
        best_len = len;
      }
    }
    if (whole == nullptr) {
      m.partial = best;
      m.partial_tokens = best_len;
      break;
    }
    m.path.push_back(whole);
    at = whole;
    pos += block_tokens_;
  }
  return m;
}

CacheNode* PrefixCache::find_child(CacheNode* parent, std::span<const int32_t> tokens) const {
  for (const auto& c : children_of(parent)) {
    if (std::equal(c->tokens.begin(), c->tokens.end(), tokens.begin(), tokens.end())) return c.get();
  }
  return nullptr;
}

CacheNode* PrefixCache::add_child(CacheNode* parent, std::span<const int32_t> tokens) {
  BG_CHECK(!tokens.empty() && static_cast<int64_t>(tokens.size()) <= block_tokens_, "prefix cache: a node of {} "
           "tokens (block size {})", tokens.size(), block_tokens_);
  BG_CHECK(find_child(parent, tokens) == nullptr, "prefix cache: adding a node twice");
  auto node = std::make_unique<CacheNode>();
  node->parent = parent;
  node->tokens.assign(tokens.begin(), tokens.end());
  node->end = (parent == nullptr ? 0 : parent->end) + static_cast<int64_t>(tokens.size());
  node->last_use = ++clock_;
  CacheNode* raw = node.get();
  children_of(parent).push_back(std::move(node));
  ++n_nodes_;
  return raw;
}

CacheNode* PrefixCache::covering_child(CacheNode* parent, std::span<const int32_t> tokens) const {
  for (const auto& c : children_of(parent)) {
    if (c->tokens.size() >= tokens.size() && common_prefix(c->tokens, tokens) == static_cast<int64_t>(tokens.size())) {
      return c.get();
    }
  }
  return nullptr;
}

std::vector<CacheNode*> PrefixCache::partial_prefixes(CacheNode* parent, std::span<const int32_t> tokens) const {
  std::vector<CacheNode*> out;
  for (const auto& c : children_of(parent)) {
    if (c->tokens.size() < tokens.size() && c->is_leaf() &&
        common_prefix(c->tokens, tokens) == static_cast<int64_t>(c->tokens.size())) {
      out.push_back(c.get());
    }
  }
  return out;
}

void PrefixCache::touch(CacheNode* node) {
  const uint64_t now = ++clock_;
  for (; node != nullptr; node = node->parent) node->last_use = now;
}

void PrefixCache::remove(CacheNode* leaf) {
  BG_CHECK(leaf != nullptr && leaf->is_leaf(), "prefix cache: removing a node that has children");
  BG_CHECK(leaf->gpu_block < 0 && leaf->host_pages.empty() && !leaf->has_snapshot(), "prefix cache: removing a node "
           "that still holds memory");
  auto& siblings = children_of(leaf->parent);
  auto it = std::find_if(siblings.begin(), siblings.end(), [&](const auto& c) { return c.get() == leaf; });
  BG_CHECK(it != siblings.end(), "prefix cache: node not found under its parent");
  siblings.erase(it);
  --n_nodes_;
}

void PrefixCache::for_each(const std::function<void(CacheNode&)>& fn) {
  std::vector<CacheNode*> stack;
  for (auto& c : root_->children) stack.push_back(c.get());
  while (!stack.empty()) {
    CacheNode* n = stack.back();
    stack.pop_back();
    fn(*n);
    for (auto& c : n->children) stack.push_back(c.get());
  }
}

}  // namespace bg::kv
