// The byte-level BPE tokenizers of the supported checkpoints: Hugging Face `tokenizer.json` (DeepSeek-V3 and others:
// normalizers, pre-tokenizers, pair merges, added tokens, post-processor) and tiktoken (Kimi K2/K3 `tiktoken.model` +
// `tokenizer_config.json`); decode to raw bytes, and stream valid UTF-8 out of generated ids.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/tokenizer/utf8.h"

namespace bg {

// tokenization_kimi.py's pat_str (Kimi K2, also used by K3) in PCRE2 syntax. PCRE2 10.42 has no class intersection,
// so the original's `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]` is written as the negated class of everything else
// (every code point is in exactly one of L, M, N, P, S, Z, C): `[^\p{Han}\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}]`, and
// likewise for the lower-case class. Single classes keep the repeats free of backtracking frames (a lookahead per
// character overflows the JIT stack on a 100 KB word). The rest is verbatim: Han runs, cased letter runs with an
// optional English contraction, digits in groups of 1-3, punctuation runs, newlines, and whitespace.
inline constexpr std::string_view kKimiPattern =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?[^\p{Han}\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}]*[^\p{Han}\p{Lu}\p{Lt}\p{N}\p{P}\p{S}\p{Z}\p{C}]+)"
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[^\p{Han}\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}]+[^\p{Han}\p{Lu}\p{Lt}\p{N}\p{P}\p{S}\p{Z}\p{C}]*)"
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

// tiktoken's o200k_base pat_str (GPT-4o), PCRE2 syntax (verbatim; used to test against js-tiktoken).
inline constexpr std::string_view kO200kPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n/]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

// DeepSeek-V3's tokenizer.json pre-tokenizer: three Isolated splits (digit groups of 1-3, CJK runs of the basic Han
// block + Hiragana + Katakana, then this main pattern), as the published file writes them (literal CR/LF inside).
inline constexpr std::string_view kDeepSeekV3DigitsPattern = "\\p{N}{1,3}";
inline constexpr std::string_view kDeepSeekV3CjkPattern = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+";
inline constexpr std::string_view kDeepSeekV3MainPattern =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";

struct TokenizerSpec {  // what a model directory's tokenizer files say
  std::string pattern;  // pre-tokenizer regex (PCRE2 syntax, UTF mode)
  std::vector<std::pair<std::string, int32_t>> special_tokens;  // text -> id
  int32_t bos_id = -1, eos_id = -1, pad_id = -1;
};

class Tokenizer {
 public:
  // <dir>/tokenizer.json when the directory has one (+ tokenizer_config.json, optional: bos/eos/pad names and extra
  // added tokens), else <dir>/tiktoken.model + tokenizer_config.json. Throws bg::Error naming both files when neither
  // exists, and naming the file and field of anything invalid.
  static Tokenizer load(const std::filesystem::path& dir);
  // A parsed tokenizer.json (+ the parsed tokenizer_config.json or null); `where` names the file in errors. Only
  // byte-level BPE models are supported (others are refused with a message saying so).
  static Tokenizer from_hf_json(const nlohmann::json& tokenizer, const nlohmann::json& config,
                                const std::string& where);
  // <dir>/tiktoken.model (one "base64-token rank" per line) + <dir>/tokenizer_config.json (added_tokens_decoder with
  // the special tokens, bos_token/eos_token/pad_token); the Kimi K2/K3 pre-tokenizer pattern. Control slots in the
  // 256 ids above the ranks that the config leaves unnamed get Kimi's "<|reserved_token_<id>|>". Throws bg::Error
  // naming the file and line on bad input (bad base64, duplicate ranks/tokens, non-integer rank, missing file).
  static Tokenizer load_tiktoken(const std::filesystem::path& dir);
  // ranks: token bytes -> rank (= id). Throws bg::Error on duplicate bytes or ids, a negative id, a special token
  // whose id is a rank's, or a bad pattern.
  static Tokenizer from_ranks(std::vector<std::pair<std::string, int32_t>> ranks, TokenizerSpec spec);

  // Special-token strings are plain text (tokenizer.json: non-special added tokens, e.g. chat markers, still match,
  // as in Hugging Face with split_special_tokens). Throws bg::Error on text that is not valid UTF-8 (tokenizer.json).
  std::vector<int32_t> encode(std::string_view text) const;
  // Every added/special-token string -> its id (what a rendered chat template is encoded with).
  std::vector<int32_t> encode_with_special(std::string_view text) const;
  // The post-processor's template around one sequence (tokenizer.json TemplateProcessing: e.g. BOS + ids); the ids
  // unchanged for tiktoken. What Hugging Face's `tokenizer(text)` (add_special_tokens=True) returns.
  std::vector<int32_t> with_template(std::span<const int32_t> ids) const;
  std::string decode(std::span<const int32_t> ids) const;                // raw bytes (may end mid code point)
  std::optional<int32_t> special_id(std::string_view text) const;  // any added token (special or not) by its text
  bool is_special(int32_t id) const;  // an added token marked special (the detokenizer skips these)
  bool is_control(int32_t id) const;  // any added token: special, or a non-special marker such as <｜User｜>
  bool is_hf() const;                 // loaded from tokenizer.json
  int64_t vocab_size() const;                                            // max id + 1 over ranks and specials
  std::string_view token_bytes(int32_t id) const;                        // throws on an unknown id
  // Whether `id` names a rank or a special token (ids in gaps of the vocabulary do not).
  bool is_known(int32_t id) const;
  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t pad_id() const;
  const std::string& pattern() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  void encode_ordinary(std::string_view text, std::vector<int32_t>& out) const;
  std::shared_ptr<const Impl> impl_;  // immutable after construction: copies share it, any thread may encode
};

// The ranks of a tiktoken.model file ("base64-token rank" per line, empty lines skipped). Throws bg::Error naming the
// file and line on bad base64, a non-integer rank, a duplicate token or rank, or a missing file.
std::vector<std::pair<std::string, int32_t>> read_tiktoken_model(const std::filesystem::path& path);

// Streams text out of generated ids without ever emitting a broken UTF-8 sequence mid-stream. With skip_special,
// special tokens contribute nothing (bytes of a code point split around one still join up); otherwise their text is
// emitted. An id the tokenizer does not know becomes U+FFFD (never throws: generated ids come from a model whose
// vocabulary may be wider than the tokenizer's).
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tok, bool skip_special = true);
  std::string push(int32_t id);   // newly completed valid UTF-8 (possibly empty)
  std::string flush();            // what is left at the end; invalid bytes become U+FFFD

 private:
  Tokenizer tok_;  // a copy (shared immutable data): the caller's object may move or go away
  bool skip_special_;
  Utf8Assembler utf8_;
};

}  // namespace bg
