// tokenizer.json encoding: added tokens split out first (raw, then on normalized text, with the lstrip / rstrip /
// single_word rules of the Rust crate), the normalizer and pre-tokenizer over the rest, then byte-level BPE with pair
// merges (lowest merge rank first, leftmost on ties) over a linked list + min-heap.
#include <queue>

#include "core/error.h"
#include "server/tokenizer/tokenizer_impl.h"
#include "server/tokenizer/unicode_text.h"

namespace bg {
namespace {

struct Section {
  int32_t added = -1;  // index into HfModel::added, or -1 for text
  std::string text;
};

// Splits `text` at the added tokens `finder` matches: leftmost-longest, a single_word token only between non-word
// characters, lstrip / rstrip absorbing the whitespace beside the token (never whitespace an earlier token took).
std::vector<Section> split_added(std::string_view text, const std::optional<Regex>& finder, const BytesToId& index,
                                 const std::vector<HfAddedToken>& added) {
  std::vector<Section> out;
  if (!finder) {
    out.push_back({-1, std::string(text)});
    return out;
  }
  size_t done = 0, from = 0, b = 0, e = 0;
  while (from < text.size() && finder->find(text, from, b, e)) {
    from = e;
    const int32_t k = index.find(text.substr(b, e - b))->second;
    const HfAddedToken& a = added[static_cast<size_t>(k)];
    if (a.single_word) {
      size_t s = 0;
      const bool left_ok = b == 0 || !is_word_char(previous_code_point(text, b, s));
      size_t p = e;
      const bool right_ok = e == text.size() || !is_word_char(next_code_point(text, p));
      if (!left_ok || !right_ok) continue;
    }
    if (a.lstrip) {
      while (b > done) {
        size_t s = 0;
        if (!is_unicode_whitespace(previous_code_point(text, b, s))) break;
        b = s;
      }
    }
    if (a.rstrip) {
      while (e < text.size()) {
        size_t p = e;
        if (!is_unicode_whitespace(next_code_point(text, p))) break;
        e = p;
      }
      from = e;
    }
    if (b > done) out.push_back({-1, std::string(text.substr(done, b - done))});
    out.push_back({k, {}});
    done = e;
  }
  if (done < text.size()) out.push_back({-1, std::string(text.substr(done))});
  return out;
}

}  // namespace

void Tokenizer::Impl::hf_encode(std::string_view text, bool with_special, std::vector<int32_t>& out) const {
  BG_CHECK(is_valid_utf8(text), "tokenizer: the text is not valid UTF-8");
  const HfModel& m = *hf;
  for (Section& raw : split_added(text, with_special ? m.raw_all : m.raw_plain, m.added_raw, m.added)) {
    if (raw.added >= 0) {
      out.push_back(m.added[static_cast<size_t>(raw.added)].id);
      continue;
    }
    const std::string normalized = m.normalizer ? m.normalizer->apply(std::move(raw.text)) : std::move(raw.text);
    for (Section& sec : split_added(normalized, with_special ? m.norm_all : m.norm_plain, m.added_normalized,
                                    m.added)) {
      if (sec.added >= 0) {
        out.push_back(m.added[static_cast<size_t>(sec.added)].id);
        continue;
      }
      if (sec.text.empty()) continue;
      std::vector<std::string> pieces{std::move(sec.text)};
      if (m.pre_tokenizer) m.pre_tokenizer->apply(pieces);
      for (const std::string& p : pieces) hf_bpe(p, out);
    }
  }
}

void Tokenizer::Impl::hf_bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (hf->ignore_merges) {
    if (const int32_t whole = rank_of(piece); whole != kNoRank) {
      out.push_back(whole);
      return;
    }
  }
  const auto n = static_cast<uint32_t>(piece.size());
  std::vector<int32_t> id(n);
  std::vector<uint32_t> next(n), prev(n);
  std::vector<int32_t> pair_rank(n, kNoRank), pair_merged(n, kNoRank);
  for (uint32_t i = 0; i < n; ++i) {
    id[i] = byte_rank[static_cast<unsigned char>(piece[i])];
    next[i] = i + 1;
    prev[i] = i == 0 ? n : i - 1;  // n = none
  }
  using Candidate = std::pair<int32_t, uint32_t>;  // (merge rank, left node)
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto refresh = [&](uint32_t i) {
    pair_rank[i] = kNoRank;
    if (next[i] >= n) return;
    const uint64_t key = (uint64_t(uint32_t(id[i])) << 32) | uint32_t(id[next[i]]);
    if (auto it = hf->merges.find(key); it != hf->merges.end()) {
      pair_rank[i] = it->second.first;
      pair_merged[i] = it->second.second;
      heap.emplace(pair_rank[i], i);
    }
  };
  for (uint32_t i = 0; i + 1 < n; ++i) refresh(i);
  std::vector<uint8_t> alive(n, 1);
  while (!heap.empty()) {
    const auto [r, i] = heap.top();
    heap.pop();
    if (!alive[i] || pair_rank[i] != r) continue;  // stale: the pair changed since it was queued
    const uint32_t j = next[i];
    alive[j] = 0;
    id[i] = pair_merged[i];
    next[i] = next[j];
    if (next[i] < n) prev[next[i]] = i;
    refresh(i);
    if (prev[i] < n) refresh(prev[i]);
  }
  for (uint32_t i = 0; i < n; i = next[i]) out.push_back(id[i]);
}

}  // namespace bg
