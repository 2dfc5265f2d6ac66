// Tokenizer::load: picks the model directory's tokenizer files (tokenizer.json, else tiktoken.model), and reads a
// Kimi-style directory (tiktoken.model ranks + tokenizer_config.json special tokens), validating both files and naming
// the file and line (or JSON key) of anything wrong.
#include <algorithm>
#include <charconv>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "server/tokenizer/base64.h"
#include "server/tokenizer/tokenizer.h"

namespace bg {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Kimi's tokenization_kimi.py names the 256 control slots above the ranks; unnamed ones are reserved tokens.
constexpr int32_t kNumControlSlots = 256;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  BG_CHECK(in.good(), "{}: cannot open the file", path.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::vector<std::pair<std::string, int32_t>> read_tiktoken_model(const fs::path& path) {
  const std::string text = read_file(path);
  std::vector<std::pair<std::string, int32_t>> ranks;
  std::map<std::string, size_t, std::less<>> line_of_bytes;
  std::map<int32_t, size_t> line_of_rank;
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;  // tiktoken skips empty lines
    const size_t space = line.find(' ');
    BG_CHECK(space != std::string_view::npos && line.find(' ', space + 1) == std::string_view::npos,
             "{}:{}: expected 'base64-token rank', got '{}'", path.string(), line_no, line.substr(0, 80));
    const std::string_view b64 = line.substr(0, space), rank_text = line.substr(space + 1);
    std::optional<std::string> bytes = base64_decode(b64);
    BG_CHECK(bytes.has_value() && !bytes->empty(), "{}:{}: bad base64 token '{}'", path.string(), line_no,
             b64.substr(0, 80));
    int32_t rank = -1;
    const auto [end, ec] = std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    BG_CHECK(ec == std::errc() && end == rank_text.data() + rank_text.size() && rank >= 0,
             "{}:{}: rank '{}' is not a non-negative 32-bit integer", path.string(), line_no, rank_text.substr(0, 40));
    auto [bit, new_bytes] = line_of_bytes.emplace(*bytes, line_no);
    BG_CHECK(new_bytes, "{}:{}: duplicate token '{}' (also on line {})", path.string(), line_no, b64, bit->second);
    auto [rit, new_rank] = line_of_rank.emplace(rank, line_no);
    BG_CHECK(new_rank, "{}:{}: duplicate rank {} (also on line {})", path.string(), line_no, rank, rit->second);
    ranks.emplace_back(std::move(*bytes), rank);
  }
  BG_CHECK(!ranks.empty(), "{}: no ranks in the file", path.string());
  return ranks;
}

namespace {

// bos_token / eos_token / pad_token: a string, {"content": string, ...} (older HF files), or null/absent.
std::optional<std::string> token_name(const json& config, const char* key, const fs::path& path) {
  if (!config.contains(key) || config[key].is_null()) return std::nullopt;
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  BG_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(),
           "{}: {} must be a string or an object with a string 'content'", path.string(), key);
  return v["content"].get<std::string>();
}

struct ConfigTokens {
  std::vector<std::pair<std::string, int32_t>> specials;
  std::optional<std::string> bos, eos, pad;
};

ConfigTokens parse_tokenizer_config(const fs::path& path) {
  json config = json::parse(read_file(path), nullptr, /*allow_exceptions=*/false);
  BG_CHECK(!config.is_discarded() && config.is_object(), "{}: not a JSON object", path.string());
  ConfigTokens out;
  if (config.contains("added_tokens_decoder")) {
    const json& added = config["added_tokens_decoder"];
    BG_CHECK(added.is_object(), "{}: added_tokens_decoder must be an object", path.string());
    for (const auto& [key, entry] : added.items()) {
      int32_t id = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      BG_CHECK(ec == std::errc() && end == key.data() + key.size() && id >= 0,
               "{}: added_tokens_decoder key '{}' is not a token id", path.string(), key);
      BG_CHECK(entry.is_object() && entry.contains("content") && entry["content"].is_string(),
               "{}: added_tokens_decoder['{}'] needs a string 'content'", path.string(), key);
      out.specials.emplace_back(entry["content"].get<std::string>(), id);
    }
  }
  out.bos = token_name(config, "bos_token", path);
  out.eos = token_name(config, "eos_token", path);
  out.pad = token_name(config, "pad_token", path);
  return out;
}

}  // namespace

Tokenizer Tokenizer::load(const fs::path& dir) {
  const fs::path hf_path = dir / "tokenizer.json";
  const fs::path tiktoken_path = dir / "tiktoken.model";
  std::error_code ec;
  if (fs::exists(hf_path, ec)) {
    const fs::path config_path = dir / "tokenizer_config.json";
    json config;  // null when absent: tokenizer.json alone is a complete tokenizer
    if (fs::exists(config_path, ec)) {
      config = json::parse(read_file(config_path), nullptr, /*allow_exceptions=*/false);
      BG_CHECK(!config.is_discarded() && config.is_object(), "{}: not a JSON object", config_path.string());
    }
    const json tokenizer = json::parse(read_file(hf_path), nullptr, /*allow_exceptions=*/false);
    BG_CHECK(!tokenizer.is_discarded(), "{}: not valid JSON (or not valid UTF-8)", hf_path.string());
    return from_hf_json(tokenizer, config, hf_path.string());
  }
  BG_CHECK(fs::exists(tiktoken_path, ec), "{}: no tokenizer: neither tokenizer.json (Hugging Face) nor "
           "tiktoken.model (Kimi) is in the directory", dir.string());
  return load_tiktoken(dir);
}

Tokenizer Tokenizer::load_tiktoken(const fs::path& dir) {
  const fs::path model_path = dir / "tiktoken.model";
  const fs::path config_path = dir / "tokenizer_config.json";
  std::vector<std::pair<std::string, int32_t>> ranks = read_tiktoken_model(model_path);
  ConfigTokens config = parse_tokenizer_config(config_path);

  int32_t max_rank = 0, max_special = -1;
  for (const auto& [b, id] : ranks) max_rank = std::max(max_rank, id);
  std::vector<bool> is_rank(static_cast<size_t>(max_rank) + 1, false);
  for (const auto& [b, id] : ranks) is_rank[id] = true;
  std::map<int32_t, std::string> by_id;
  for (const auto& [text, id] : config.specials) {
    BG_CHECK(id > max_rank || !is_rank[id], "{}: added token '{}' reuses id {} of {}", config_path.string(), text, id,
             model_path.string());
    auto [it, inserted] = by_id.emplace(id, text);
    BG_CHECK(inserted, "{}: ids of added tokens '{}' and '{}' are both {}", config_path.string(), it->second, text, id);
    max_special = std::max(max_special, id);
  }
  // Unnamed control slots inside the declared range get reserved names, so every id up to the last special decodes.
  for (int32_t id = max_rank + 1; id < std::min(max_rank + 1 + kNumControlSlots, max_special); ++id) {
    if (!by_id.count(id)) config.specials.emplace_back("<|reserved_token_" + std::to_string(id) + "|>", id);
  }

  TokenizerSpec spec;
  spec.pattern = std::string(kKimiPattern);
  spec.special_tokens = config.specials;
  auto resolve = [&](const std::optional<std::string>& name, const char* what) -> int32_t {
    if (!name) return -1;
    for (const auto& [text, id] : config.specials) {
      if (text == *name) return id;
    }
    for (const auto& [bytes, id] : ranks) {
      if (bytes == *name) return id;
    }
    fail("{}: {} '{}' is neither an added token nor in {}", config_path.string(), what, *name, model_path.string());
  };
  spec.bos_id = resolve(config.bos, "bos_token");
  spec.eos_id = resolve(config.eos, "eos_token");
  spec.pad_id = resolve(config.pad, "pad_token");
  return from_ranks(std::move(ranks), std::move(spec));
}

}  // namespace bg
