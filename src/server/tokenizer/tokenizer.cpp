// Tokenizer construction from ranks, byte-level BPE encode (rank-ordered merges over a linked list + min-heap, so a
// long piece costs O(n log n)), decode, and the incremental detokenizer.
#include "server/tokenizer/tokenizer.h"

#include <algorithm>
#include <queue>

#include "core/error.h"
#include "server/tokenizer/tokenizer_impl.h"

namespace bg {

std::string literal_alternation(std::vector<std::string> texts) {
  std::sort(texts.begin(), texts.end(),
            [](const std::string& a, const std::string& b) { return a.size() != b.size() ? a.size() > b.size() : a < b; });
  std::string p;
  for (const auto& t : texts) {
    if (!p.empty()) p.push_back('|');
    for (char ch : t) {
      const auto u = static_cast<unsigned char>(ch);
      const bool alnum = (u >= '0' && u <= '9') || (u >= 'a' && u <= 'z') || (u >= 'A' && u <= 'Z');
      if (u < 0x80 && !alnum) p.push_back('\\');  // backslash + ASCII non-alphanumeric = that character
      p.push_back(ch);
    }
  }
  return p;
}

int32_t Tokenizer::Impl::single_byte(unsigned char b) const {
  BG_CHECK(byte_rank[b] != kNoRank, "tokenizer: the vocabulary has no token for byte 0x{:02x}", int(b));
  return byte_rank[b];
}

// Merges adjacent parts of `piece`, always the pair whose concatenation has the lowest rank (leftmost on ties), until
// no adjacent pair is a token: tiktoken's byte_pair_merge. Parts form a linked list over byte offsets; a min-heap holds
// (rank, left offset) candidates, stale ones are skipped (a pair's rank is its identity: ranks are unique per bytes).
void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (piece.size() == 1) {
    out.push_back(single_byte(static_cast<unsigned char>(piece[0])));
    return;
  }
  if (const int32_t whole = rank_of(piece); whole != kNoRank) {
    out.push_back(whole);
    return;
  }
  const auto n = static_cast<uint32_t>(piece.size());
  std::vector<uint32_t> next(n), prev(n);
  std::vector<int32_t> pair_rank(n, kNoRank);
  std::vector<uint8_t> alive(n, 1);
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i == 0 ? n : i - 1;  // n = none
  }
  auto pair_rank_at = [&](uint32_t i) -> int32_t {
    const uint32_t j = next[i];
    if (j >= n) return kNoRank;
    return rank_of(piece.substr(i, next[j] - i));
  };
  using Candidate = std::pair<int32_t, uint32_t>;  // (rank, left offset)
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  for (uint32_t i = 0; i + 1 < n; ++i) {
    pair_rank[i] = pair_rank_at(i);
    if (pair_rank[i] != kNoRank) heap.emplace(pair_rank[i], i);
  }
  while (!heap.empty()) {
    const auto [r, i] = heap.top();
    heap.pop();
    if (!alive[i] || pair_rank[i] != r) continue;  // stale
    const uint32_t j = next[i];
    alive[j] = 0;
    pair_rank[j] = kNoRank;
    next[i] = next[j];
    if (next[i] < n) prev[next[i]] = i;
    pair_rank[i] = pair_rank_at(i);
    if (pair_rank[i] != kNoRank) heap.emplace(pair_rank[i], i);
    if (const uint32_t p = prev[i]; p < n) {
      pair_rank[p] = pair_rank_at(p);
      if (pair_rank[p] != kNoRank) heap.emplace(pair_rank[p], p);
    }
  }
  for (uint32_t i = 0; i < n; i = next[i]) {
    const std::string_view part = piece.substr(i, next[i] - i);
    out.push_back(part.size() == 1 ? single_byte(static_cast<unsigned char>(part[0])) : rank_of(part));
  }
}

Tokenizer Tokenizer::from_ranks(std::vector<std::pair<std::string, int32_t>> ranks, TokenizerSpec spec) {
  auto impl = std::make_shared<Impl>();
  impl->byte_rank.fill(kNoRank);
  int32_t max_id = -1;
  for (const auto& [b, id] : ranks) max_id = std::max(max_id, id);
  for (const auto& [t, id] : spec.special_tokens) max_id = std::max(max_id, id);
  impl->bytes.resize(static_cast<size_t>(max_id + 1));
  impl->kind.assign(static_cast<size_t>(max_id + 1), IdKind::kNone);
  impl->ranks.reserve(ranks.size());
  for (auto& [b, id] : ranks) {
    BG_CHECK(id >= 0, "tokenizer: negative rank {}", id);
    BG_CHECK(!b.empty(), "tokenizer: empty token bytes for rank {}", id);
    BG_CHECK(impl->kind[id] == IdKind::kNone, "tokenizer: duplicate rank {}", id);
    auto [it, inserted] = impl->ranks.emplace(b, id);
    BG_CHECK(inserted, "tokenizer: ranks {} and {} have the same bytes", it->second, id);
    if (b.size() == 1) impl->byte_rank[static_cast<unsigned char>(b[0])] = id;
    impl->kind[id] = IdKind::kRank;
    impl->bytes[id] = std::move(b);
  }
  std::vector<std::string> texts;
  for (auto& [t, id] : spec.special_tokens) {
    BG_CHECK(id >= 0, "tokenizer: special token '{}' has negative id {}", t, id);
    BG_CHECK(!t.empty(), "tokenizer: special token {} has empty text", id);
    BG_CHECK(impl->kind[id] == IdKind::kNone, "tokenizer: special token '{}' reuses id {}", t, id);
    auto [it, inserted] = impl->specials.emplace(t, id);
    BG_CHECK(inserted, "tokenizer: special token '{}' has two ids ({} and {})", t, it->second, id);
    impl->kind[id] = IdKind::kSpecial;
    impl->bytes[id] = t;
    texts.push_back(t);
  }
  impl->pattern = spec.pattern;
  impl->pretokenizer.emplace(spec.pattern, Regex::Mode::kUnicode, "tokenizer pre-tokenizer pattern");
  if (!texts.empty()) {
    impl->special_finder.emplace(literal_alternation(std::move(texts)), Regex::Mode::kBytes, "tokenizer specials");
  }
  for (int32_t id : {spec.bos_id, spec.eos_id, spec.pad_id}) {
    BG_CHECK(id == -1 || (id >= 0 && id <= max_id && impl->kind[id] != IdKind::kNone),
             "tokenizer: bos/eos/pad id {} is not in the vocabulary", id);
  }
  impl->bos = spec.bos_id;
  impl->eos = spec.eos_id;
  impl->pad = spec.pad_id;
  return Tokenizer(std::move(impl));
}

void Tokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& out) const {
  size_t done = 0;
  // Bytes no match covers (only ill-formed UTF-8, which the pattern never matches) are BPE pieces of their own.
  impl_->pretokenizer->for_each_match(text, [&](size_t b, size_t e) {
    if (b > done) impl_->bpe(text.substr(done, b - done), out);
    impl_->bpe(text.substr(b, e - b), out);
    done = e;
  });
  if (done < text.size()) impl_->bpe(text.substr(done), out);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  if (impl_->hf) {
    impl_->hf_encode(text, /*with_special=*/false, out);
  } else {
    encode_ordinary(text, out);
  }
  return out;
}

std::vector<int32_t> Tokenizer::encode_with_special(std::string_view text) const {
  if (impl_->hf) {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 1);
    impl_->hf_encode(text, /*with_special=*/true, out);
    return out;
  }
  if (!impl_->special_finder) return encode(text);
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  size_t pos = 0, b = 0, e = 0;
  while (pos < text.size() && impl_->special_finder->find(text, pos, b, e)) {
    encode_ordinary(text.substr(pos, b - pos), out);
    out.push_back(impl_->specials.find(text.substr(b, e - b))->second);
    pos = e;
  }
  if (pos < text.size()) encode_ordinary(text.substr(pos), out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out.append(token_bytes(id));
  return out;
}

std::optional<int32_t> Tokenizer::special_id(std::string_view text) const {
  auto it = impl_->specials.find(text);
  if (it == impl_->specials.end()) return std::nullopt;
  return it->second;
}

bool Tokenizer::is_known(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->kind.size() && impl_->kind[id] != IdKind::kNone;
}

bool Tokenizer::is_special(int32_t id) const { return is_known(id) && impl_->kind[id] == IdKind::kSpecial; }

bool Tokenizer::is_control(int32_t id) const {
  return is_known(id) && (impl_->kind[id] == IdKind::kSpecial || impl_->kind[id] == IdKind::kAdded);
}

std::vector<int32_t> Tokenizer::with_template(std::span<const int32_t> ids) const {
  std::vector<int32_t> out;
  if (impl_->hf) out = impl_->hf->prefix_ids;
  out.insert(out.end(), ids.begin(), ids.end());
  if (impl_->hf) out.insert(out.end(), impl_->hf->suffix_ids.begin(), impl_->hf->suffix_ids.end());
  return out;
}

bool Tokenizer::is_hf() const { return impl_->hf != nullptr; }

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->kind.size()); }

std::string_view Tokenizer::token_bytes(int32_t id) const {
  BG_CHECK(is_known(id), "tokenizer: unknown token id {} (vocabulary size {})", id, vocab_size());
  return impl_->bytes[id];
}

int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::pad_id() const { return impl_->pad; }
const std::string& Tokenizer::pattern() const { return impl_->pattern; }

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tok, bool skip_special)
    : tok_(tok), skip_special_(skip_special) {}

std::string IncrementalDetokenizer::push(int32_t id) {
  if (!tok_.is_known(id)) {
    std::string out = utf8_.flush();  // the pending bytes can no longer complete
    out.append(kReplacementChar);
    return out;
  }
  if (skip_special_ && tok_.is_special(id)) return {};
  return utf8_.push(tok_.token_bytes(id));
}

std::string IncrementalDetokenizer::flush() { return utf8_.flush(); }

}  // namespace bg
