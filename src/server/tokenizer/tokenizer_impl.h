// Tokenizer internals shared by the tiktoken (tokenizer.cpp) and Hugging Face tokenizer.json (hf_tokenizer.cpp)
// models: the vocabulary tables and, for tokenizer.json, the merges and text pipeline. Immutable once built.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "server/tokenizer/hf_pipeline.h"
#include "server/tokenizer/regex.h"
#include "server/tokenizer/tokenizer.h"

namespace bg {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using BytesToId = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// kSpecial: an added token marked special (skipped by the detokenizer); kAdded: an added token that is not special
// (tokenizer.json's chat markers such as DeepSeek's <｜User｜>), decoded as text but never produced by BPE.
enum class IdKind : uint8_t { kNone, kRank, kSpecial, kAdded };
inline constexpr int32_t kNoRank = -1;

// A PCRE2 pattern matching any of `texts` literally, longest first (so the longest token wins at a position).
std::string literal_alternation(std::vector<std::string> texts);

// tokenizer.json added token (the Rust crate's AddedToken).
struct HfAddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// What tokenizer.json adds on top of the vocabulary: its BPE merges and text stages.
struct HfModel {
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left id << 32 | right id) -> (rank, merged)
  bool ignore_merges = false;
  std::unique_ptr<HfNormalizer> normalizer;
  std::unique_ptr<HfPreTokenizer> pre_tokenizer;
  std::vector<HfAddedToken> added;
  BytesToId added_raw, added_normalized;  // matched text -> index into `added`
  // Finders over added-token texts: raw (normalized=false) / normalized, all / non-special only.
  std::optional<Regex> raw_all, raw_plain, norm_all, norm_plain;
  std::vector<int32_t> prefix_ids, suffix_ids;  // the post-processor's template for one sequence
};

struct Tokenizer::Impl {
  BytesToId ranks;                 // token bytes -> rank (= id); for tokenizer.json: the model vocabulary
  BytesToId specials;              // added-token text -> id
  std::vector<std::string> bytes;  // id -> token bytes (added token: its text)
  std::vector<IdKind> kind;        // id -> what it is
  std::array<int32_t, 256> byte_rank{};
  std::optional<Regex> pretokenizer;    // tiktoken only
  std::optional<Regex> special_finder;  // tiktoken only; empty when there are no special tokens
  std::unique_ptr<HfModel> hf;          // tokenizer.json only
  std::string pattern;
  int32_t bos = -1, eos = -1, pad = -1;

  int32_t rank_of(std::string_view b) const {
    auto it = ranks.find(b);
    return it == ranks.end() ? kNoRank : it->second;
  }
  int32_t single_byte(unsigned char b) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;     // tiktoken rank merges
  void hf_bpe(std::string_view piece, std::vector<int32_t>& out) const;  // tokenizer.json pair merges
  void hf_encode(std::string_view text, bool with_special, std::vector<int32_t>& out) const;
};

}  // namespace bg
