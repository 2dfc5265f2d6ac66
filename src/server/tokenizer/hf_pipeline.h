// The text stages of a Hugging Face tokenizer.json before the model: normalizers (text -> text) and pre-tokenizers
// (pieces -> finer pieces), built from their JSON with every field validated. Semantics follow the Rust `tokenizers`
// crate (see docs/TOKENIZER_AND_CHAT.md for the supported types).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace bg {

class HfNormalizer {
 public:
  virtual ~HfNormalizer() = default;
  virtual std::string apply(std::string text) const = 0;  // valid UTF-8 in, valid UTF-8 out
};

class HfPreTokenizer {
 public:
  virtual ~HfPreTokenizer() = default;
  // Splits every piece further (or rewrites it); empty pieces are dropped.
  virtual void apply(std::vector<std::string>& pieces) const = 0;
};

// `where` names the JSON path in errors ("tokenizer.json: normalizer.normalizers[1]"). null -> nullptr. Throws
// bg::Error on a wrong type, a missing field or an unsupported component type (named with the supported ones).
std::unique_ptr<HfNormalizer> parse_hf_normalizer(const nlohmann::json& j, const std::string& where);
std::unique_ptr<HfPreTokenizer> parse_hf_pre_tokenizer(const nlohmann::json& j, const std::string& where);

// Whether the pre-tokenizer (or one in its Sequence) is ByteLevel: the model's vocabulary is then byte-level encoded.
bool hf_pre_tokenizer_is_byte_level(const nlohmann::json& j);

// GPT-2's byte -> printable character map (bytes_to_unicode), as UTF-8 strings, and its inverse (code point -> byte,
// -1 when the character is not in the map).
const std::vector<std::string>& byte_level_chars();
int byte_level_byte(char32_t c);

}  // namespace bg
