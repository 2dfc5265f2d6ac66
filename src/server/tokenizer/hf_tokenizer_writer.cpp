// tokenizer.json + tokenizer_config.json of DeepSeek-V3's layout for random checkpoints: the published file's
// normalizer, pre-tokenizer, post-processor and decoder, a byte-level BPE vocabulary with pair merges trained on the
// embedded corpus (filler merges past its end), and the added tokens of the layout.
#include <fmt/format.h>

#include <fstream>
#include <set>

#include "core/error.h"
#include "server/tokenizer/hf_pipeline.h"
#include "server/tokenizer/tokenizer.h"
#include "server/tokenizer/tokenizer_writer.h"

namespace bg {
namespace {

using nlohmann::ordered_json;

std::string byte_level(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) out += byte_level_chars()[b];
  return out;
}

ordered_json split(std::string_view pattern) {
  return {{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}};
}

// The BPE merges: trained pairs, then (past the corpus) filler tokens built by merging a printable byte into the
// previous filler, so every merged token has a merge that makes it.
std::vector<std::pair<std::string, std::string>> merges_for(size_t n_merges) {
  auto merges = train_bpe_pairs(tokenizer_training_corpus(), deepseek_v3_training_pattern(), std::min<size_t>(n_merges, 4096));
  std::set<std::string> taken;
  for (int b = 0; b < 256; ++b) taken.insert(std::string(1, static_cast<char>(b)));
  for (const auto& [a, b] : merges) taken.insert(a + b);
  for (int first = 0x21; merges.size() < n_merges && first < 0x7F; ++first) {
    std::string left(1, static_cast<char>(first));
    for (int next = 0x21; merges.size() < n_merges && next < 0x7F; ++next) {
      const std::string right(1, static_cast<char>(next));
      if (taken.insert(left + right).second) merges.emplace_back(left, right);
    }
  }
  BG_CHECK(merges.size() == n_merges, "tokenizer files: cannot make {} merges", n_merges);
  return merges;
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  BG_CHECK(out.good(), "cannot write '{}'", path.string());
  out << text;
  BG_CHECK(out.good(), "cannot write '{}'", path.string());
}

ordered_json added_token(int32_t id, const std::string& text, bool special) {
  // DeepSeek marks its chat markers "special": false and normalized; the control tokens special, not normalized.
  return {{"id", id},          {"content", text},           {"single_word", false}, {"lstrip", false},
          {"rstrip", false},   {"normalized", !special},    {"special", special}};
}

}  // namespace

void write_hf_tokenizer_files(const std::filesystem::path& dir, const TokenizerFileLayout& l) {
  BG_CHECK(l.n_ranks >= 256, "tokenizer files: {} ranks cannot hold the 256 byte tokens", l.n_ranks);
  ordered_json vocab = ordered_json::object();
  for (const auto& [id, text] : l.specials) {
    if (id < l.first_rank_id) vocab[text] = id;  // DeepSeek's control tokens 0..2 are in the model vocabulary too
  }
  int32_t next_id = l.first_rank_id;
  for (int b = 0; b < 256; ++b) vocab[byte_level(std::string(1, static_cast<char>(b)))] = next_id++;
  ordered_json merges = ordered_json::array();
  for (const auto& [a, b] : merges_for(static_cast<size_t>(l.n_ranks - 256))) {
    merges.push_back(ordered_json::array({byte_level(a), byte_level(b)}));
    vocab[byte_level(a + b)] = next_id++;
  }
  ordered_json added = ordered_json::array();
  for (const auto& [id, text] : l.specials) {
    const bool special = std::find(l.not_special.begin(), l.not_special.end(), text) == l.not_special.end();
    added.push_back(added_token(id, text, special));
  }
  const ordered_json bos_entry = {{"id", l.bos}, {"ids", {0}}, {"tokens", {l.bos}}};
  ordered_json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", {{"type", "Sequence"}, {"normalizers", ordered_json::array()}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {split(kDeepSeekV3DigitsPattern), split(kDeepSeekV3CjkPattern), split(kDeepSeekV3MainPattern),
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", l.bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair",
         {{{"SpecialToken", {{"id", l.bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
          {{"SpecialToken", {{"id", l.bos}, {"type_id", 1}}}}, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
        {"special_tokens", {{l.bos, bos_entry}}}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merges}}},
  };
  auto token_entry = [](const std::string& text) -> ordered_json {
    if (text.empty()) return nullptr;
    return {{"__type", "AddedToken"}, {"content", text}, {"lstrip", false}, {"normalized", true},
            {"rstrip", false},        {"single_word", false}};
  };
  ordered_json config = {
      {"add_bos_token", true},
      {"add_eos_token", false},
      {"bos_token", token_entry(l.bos)},
      {"clean_up_tokenization_spaces", false},
      {"eos_token", token_entry(l.eos)},
      {"legacy", true},
      {"model_max_length", 131072},
      {"pad_token", token_entry(l.pad)},
      {"sp_model_kwargs", ordered_json::object()},
      {"unk_token", nullptr},
      {"tokenizer_class", "LlamaTokenizerFast"},
  };
  if (!l.chat_template.empty()) config["chat_template"] = l.chat_template;
  write_file(dir / "tokenizer.json", tokenizer.dump(1) + "\n");
  write_file(dir / "tokenizer_config.json", config.dump(2) + "\n");
}

}  // namespace bg
