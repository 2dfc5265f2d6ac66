// Tokenizer file writing for random checkpoints (see tokenizer_writer.h): layouts, BPE training, file formats.
#include "server/tokenizer/tokenizer_writer.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <unordered_map>

#include "core/error.h"
#include "server/tokenizer/base64.h"
#include "server/tokenizer/regex.h"
#include "server/tokenizer/tokenizer.h"
#include "server/chat/chat_templates.h"

namespace bg {
namespace {

using nlohmann::json;

constexpr int32_t kControlSlots = 256;

// Kimi K3's named control slots (docs/kimi_k3.md section 3), as offsets from the first slot.
const std::vector<std::pair<int32_t, const char*>>& kimi_named_slots() {
  static const std::vector<std::pair<int32_t, const char*>> s = {
      {0, "[BOS]"},   {1, "[EOS]"},        {2, "<|end_of_msg|>"},   {3, "<|open|>"},
      {4, "<|close|>"}, {5, "<|sep|>"},    {6, "[start_header_id]"}, {7, "[end_header_id]"},
      {9, "[EOT]"},   {18, "<|media_begin|>"}, {19, "<|media_content|>"}, {20, "<|media_end|>"},
      {21, "<|media_pad|>"}, {65, "<osagent_mode>"}, {254, "[UNK]"}, {255, "[PAD]"},
  };
  return s;
}

// Tokens of `word` (ids into vocab) after merging every adjacent (a, b) into `merged`.
void apply_merge(std::vector<int32_t>& word, int32_t a, int32_t b, int32_t merged) {
  size_t out = 0;
  for (size_t i = 0; i < word.size(); ++i) {
    if (i + 1 < word.size() && word[i] == a && word[i + 1] == b) {
      word[out++] = merged;
      ++i;
    } else {
      word[out++] = word[i];
    }
  }
  word.resize(out);
}

// Distinct byte strings not in `taken`, shortest first (2 bytes, then 3): tokens for ranks the corpus cannot fill.
std::vector<std::string> filler_tokens(const std::set<std::string>& taken, size_t n) {
  std::vector<std::string> out;
  for (size_t len = 2; out.size() < n; ++len) {
    std::string s(len, 'a');
    // Printable ASCII first so the files stay readable; the enumeration is deterministic.
    std::vector<size_t> digits(len, 0);
    while (out.size() < n) {
      for (size_t k = 0; k < len; ++k) s[k] = static_cast<char>(0x21 + digits[k]);
      if (!taken.count(s)) out.push_back(s);
      size_t k = len;
      while (k > 0 && ++digits[k - 1] == 94) digits[--k] = 0;
      if (k == 0) break;
    }
  }
  return out;
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  BG_CHECK(out.good(), "cannot write '{}'", path.string());
  out << text;
  BG_CHECK(out.good(), "cannot write '{}'", path.string());
}

}  // namespace

TokenizerFileLayout kimi_tokenizer_layout(int64_t vocab_size) {
  BG_CHECK(vocab_size > 256 + kControlSlots && vocab_size <= INT32_MAX,
           "kimi tokenizer: vocab_size {} leaves no room for 256 byte tokens, merges and 256 control slots",
           vocab_size);
  TokenizerFileLayout l;
  l.vocab_size = vocab_size;
  l.n_ranks = static_cast<int32_t>(vocab_size) - kControlSlots;
  std::map<int32_t, std::string> named;
  for (const auto& [offset, name] : kimi_named_slots()) named[offset] = name;
  for (int32_t k = 0; k < kControlSlots; ++k) {
    const int32_t id = l.n_ranks + k;
    l.specials.emplace_back(id, named.count(k) ? named[k] : fmt::format("<|reserved_token_{}|>", id));
  }
  l.bos = "[BOS]";
  l.eos = "[EOS]";
  l.pad = "[PAD]";
  l.unk = "[UNK]";
  return l;
}

TokenizerFileLayout kimi_k2_tokenizer_layout(int64_t vocab_size) {
  TokenizerFileLayout l = kimi_tokenizer_layout(vocab_size);
  static const std::pair<int32_t, const char*> kK2[] = {
      {2, "<|im_end|>"},        {3, "<|im_user|>"},     {4, "<|im_assistant|>"},
      {5, "<|reserved_token_5|>"}, {6, "<|start_header_id|>"}, {7, "<|end_header_id|>"},
      {10, "<|im_system|>"},    {11, "<|tool_calls_section_begin|>"}, {12, "<|tool_calls_section_end|>"},
      {13, "<|tool_call_begin|>"}, {14, "<|tool_call_argument_begin|>"}, {15, "<|tool_call_end|>"},
      {17, "<|im_middle|>"},   {22, "<think>"},        {23, "</think>"},
  };
  for (const auto& [offset, name] : kK2) {
    const int32_t id = l.n_ranks + offset;
    for (auto& [sid, text] : l.specials) {
      if (sid == id) text = offset == 5 ? fmt::format("<|reserved_token_{}|>", id) : name;
    }
  }
  for (auto& [sid, text] : l.specials) {  // K3-only names do not exist in K2
    if (text == "<|open|>" || text == "<|close|>" || text == "<|sep|>" || text == "<|end_of_msg|>" ||
        text == "<osagent_mode>") {
      text = fmt::format("<|reserved_token_{}|>", sid);
    }
  }
  return l;
}

TokenizerFileLayout deepseek_v3_tokenizer_layout(int64_t vocab_size, int32_t bos_id, int32_t eos_id) {
  static const char* kMarkers[] = {"<｜User｜>",           "<｜Assistant｜>",          "<think>",
                                   "</think>",             "<｜tool▁calls▁begin｜>",   "<｜tool▁calls▁end｜>",
                                   "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",     "<｜tool▁outputs▁begin｜>",
                                   "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                                   "<｜tool▁sep｜>"};
  const auto n_markers = static_cast<int32_t>(std::size(kMarkers));
  BG_CHECK(bos_id == 0 && eos_id == 1, "deepseek_v3 tokenizer: bos/eos ids {}/{} must be 0 and 1 (DeepSeek's layout)",
           bos_id, eos_id);
  BG_CHECK(vocab_size > 3 + 256 + n_markers && vocab_size <= INT32_MAX,
           "deepseek_v3 tokenizer: vocab_size {} is too small for 256 byte tokens and the special tokens", vocab_size);
  TokenizerFileLayout l;
  l.hf = true;
  l.vocab_size = vocab_size;
  l.first_rank_id = 3;
  l.n_ranks = static_cast<int32_t>(vocab_size) - 3 - n_markers;
  l.specials = {{0, "<｜begin▁of▁sentence｜>"}, {1, "<｜end▁of▁sentence｜>"}, {2, "<｜▁pad▁｜>"}};
  for (int32_t k = 0; k < n_markers; ++k) {
    l.specials.emplace_back(l.first_rank_id + l.n_ranks + k, kMarkers[k]);
    l.not_special.emplace_back(kMarkers[k]);
  }
  l.bos = "<｜begin▁of▁sentence｜>";
  l.eos = "<｜end▁of▁sentence｜>";
  l.pad = "<｜▁pad▁｜>";
  return l;
}

std::string_view deepseek_v3_training_pattern() {
  static const std::string p = std::string(R"(\p{N}{1,3}|[\x{4e00}-\x{9fa5}\x{3040}-\x{309f}\x{30a0}-\x{30ff}]+|)") +
                               std::string(kDeepSeekV3MainPattern);
  return p;
}

std::vector<std::string> train_bpe_merges(std::string_view corpus, std::string_view pattern, size_t n_merges) {
  std::vector<std::string> merged;
  for (auto& [a, b] : train_bpe_pairs(corpus, pattern, n_merges)) merged.push_back(a + b);
  return merged;
}

std::vector<std::pair<std::string, std::string>> train_bpe_pairs(std::string_view corpus, std::string_view pattern,
                                                                 size_t n_merges) {
  // Distinct pre-tokens with their counts (std::map: a deterministic order).
  std::map<std::string, int64_t> counts;
  Regex{std::string(pattern), Regex::Mode::kUnicode, "bpe training pattern"}.for_each_match(
      corpus, [&](size_t b, size_t e) { ++counts[std::string(corpus.substr(b, e - b))]; });
  std::vector<std::string> vocab;  // token id -> bytes (ids 0..255 are the bytes)
  std::unordered_map<std::string, int32_t> id_of;
  for (int b = 0; b < 256; ++b) {
    vocab.emplace_back(1, static_cast<char>(b));
    id_of[vocab.back()] = b;
  }
  std::vector<std::pair<std::vector<int32_t>, int64_t>> words;
  for (const auto& [w, c] : counts) {
    std::vector<int32_t> ids;
    for (unsigned char ch : w) ids.push_back(ch);
    if (ids.size() > 1) words.emplace_back(std::move(ids), c);
  }
  std::vector<std::pair<std::string, std::string>> merges;
  while (merges.size() < n_merges) {
    std::map<std::pair<int32_t, int32_t>, int64_t> pair_counts;
    for (const auto& [ids, c] : words) {
      for (size_t i = 0; i + 1 < ids.size(); ++i) pair_counts[{ids[i], ids[i + 1]}] += c;
    }
    if (pair_counts.empty()) break;
    auto best = pair_counts.begin();
    std::string merged = vocab[best->first.first] + vocab[best->first.second];
    for (auto it = std::next(pair_counts.begin()); it != pair_counts.end(); ++it) {
      if (it->second < best->second) continue;
      std::string candidate = vocab[it->first.first] + vocab[it->first.second];
      if (it->second > best->second || candidate < merged) {
        best = it;
        merged = std::move(candidate);
      }
    }
    const auto [a, b] = best->first;
    int32_t merged_id = 0;
    if (auto found = id_of.find(merged); found != id_of.end()) {
      merged_id = found->second;  // the same bytes were already made from another pair: no new token
    } else {
      merged_id = static_cast<int32_t>(vocab.size());
      vocab.push_back(merged);
      id_of[merged] = merged_id;
      merges.emplace_back(vocab[a], vocab[b]);
    }
    for (auto& [ids, c] : words) apply_merge(ids, a, b, merged_id);
    std::erase_if(words, [](const auto& w) { return w.first.size() < 2; });
  }
  return merges;
}

void write_tokenizer_files(const std::filesystem::path& dir, const TokenizerFileLayout& l) {
  if (l.hf) {
    write_hf_tokenizer_files(dir, l);
    return;
  }
  BG_CHECK(l.n_ranks >= 256, "tokenizer files: {} ranks cannot hold the 256 byte tokens", l.n_ranks);
  const auto n_merges = static_cast<size_t>(l.n_ranks - 256);
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  // Training stops early for huge vocabularies: the corpus cannot fill them, filler does.
  std::vector<std::string> merges =
      train_bpe_merges(tokenizer_training_corpus(), kKimiPattern, std::min<size_t>(n_merges, 4096));
  tokens.insert(tokens.end(), merges.begin(), merges.end());
  if (tokens.size() < static_cast<size_t>(l.n_ranks)) {
    const std::set<std::string> taken(tokens.begin(), tokens.end());
    std::vector<std::string> filler = filler_tokens(taken, l.n_ranks - tokens.size());
    tokens.insert(tokens.end(), filler.begin(), filler.end());
  }
  std::string model;
  for (size_t i = 0; i < tokens.size(); ++i) {
    model += fmt::format("{} {}\n", base64_encode(tokens[i]), l.first_rank_id + static_cast<int64_t>(i));
  }
  json added = json::object();
  for (const auto& [id, text] : l.specials) {
    added[std::to_string(id)] = {{"content", text},  {"lstrip", false},       {"normalized", false},
                                 {"rstrip", false},  {"single_word", false}, {"special", true}};
  }
  auto name_or_null = [](const std::string& s) { return s.empty() ? json() : json(s); };
  json config = {
      {"added_tokens_decoder", added},
      {"auto_map", {{"AutoTokenizer", {"tokenization_kimi.TikTokenTokenizer", nullptr}}}},
      {"bos_token", name_or_null(l.bos)},
      {"eos_token", name_or_null(l.eos)},
      {"pad_token", name_or_null(l.pad)},
      {"unk_token", name_or_null(l.unk)},
      {"clean_up_tokenization_spaces", false},
      {"model_max_length", 1048576},
      {"tokenizer_class", "TikTokenTokenizer"},
  };
  if (!l.chat_template.empty()) config["chat_template"] = l.chat_template;
  write_file(dir / "tiktoken.model", model);
  write_file(dir / "tokenizer_config.json", config.dump(2) + "\n");
}

void write_random_tokenizer(const std::string& arch, const json& config, const std::filesystem::path& dir,
                            const std::string& chat_template) {
  auto int_field = [&](const json& obj, const char* key) {
    BG_CHECK(obj.is_object() && obj.contains(key) && obj[key].is_number_integer(),
             "make-random {}: config has no integer {} for the tokenizer", arch, key);
    return obj[key].get<int64_t>();
  };
  if (arch == "kimi_k3") {
    BG_CHECK(chat_template.empty(), "make-random kimi_k3: Kimi-K3 ships no chat template (its XTML format is built "
             "in); --chat-template applies to deepseek_v3");
    BG_CHECK(config.contains("text_config"), "make-random kimi_k3: config has no text_config");
    write_tokenizer_files(dir, kimi_tokenizer_layout(int_field(config["text_config"], "vocab_size")));
    return;
  }
  BG_CHECK(arch == "deepseek_v3", "make-random: no tokenizer files for arch '{}'", arch);
  const std::string layout_name = chat_template.empty() ? "deepseek_v3.1" : chat_template;
  const int64_t vocab = int_field(config, "vocab_size");
  TokenizerFileLayout layout;
  if (layout_name == "kimi_k2") {
    BG_CHECK(config.value("model_type", json()) == "kimi_k2", "make-random: the kimi_k2 chat template needs "
             "model_type kimi_k2 in config.json (kimi_k2_config_patch)");
    layout = kimi_k2_tokenizer_layout(vocab);
    BG_CHECK(int_field(config, "bos_token_id") == layout.n_ranks && int_field(config, "eos_token_id") == layout.n_ranks + 1,
             "make-random kimi_k2: config bos/eos ids must be [BOS] {} and [EOS] {}", layout.n_ranks, layout.n_ranks + 1);
  } else {
    layout = deepseek_v3_tokenizer_layout(vocab, static_cast<int32_t>(int_field(config, "bos_token_id")),
                                          static_cast<int32_t>(int_field(config, "eos_token_id")));
  }
  layout.chat_template = std::string(builtin_chat_template(layout_name));
  write_tokenizer_files(dir, layout);
}

json kimi_k2_config_patch(int64_t vocab_size) {
  const int64_t v = std::max<int64_t>(vocab_size, 1024);
  return {{"model_type", "kimi_k2"}, {"vocab_size", v}, {"bos_token_id", v - 256}, {"eos_token_id", v - 255}};
}

}  // namespace bg
