// Tokenizer files for random-weight checkpoints: a deterministic byte-level BPE vocabulary (256 bytes + merges trained
// on a small embedded English/code corpus) with the model family's special tokens, written in Kimi's real formats
// (tiktoken.model + tokenizer_config.json) so Tokenizer::load and the chat formats work on `make-random` output.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bg {

struct TokenizerFileLayout {
  int64_t vocab_size = 0;
  int32_t first_rank_id = 0;  // the ranks take ids [first_rank_id, first_rank_id + n_ranks)
  int32_t n_ranks = 0;        // 256 single bytes + (n_ranks - 256) merges
  std::vector<std::pair<int32_t, std::string>> specials;  // id -> text, every id outside the ranks
  std::string bos, eos, pad, unk;                         // names of specials ("" = none)
};

// Kimi K2/K3: ranks 0..V-257, the 256 control slots V-256..V-1 with K3's names at their real offsets ([BOS] +0,
// [EOS] +1, <|end_of_msg|> +2, <|open|> +3, <|close|> +4, <|sep|> +5, ..., [UNK] +254, [PAD] +255) and
// "<|reserved_token_<id>|>" elsewhere. Throws bg::Error when V < 513 (no room for 256 bytes + 256 slots).
TokenizerFileLayout kimi_tokenizer_layout(int64_t vocab_size);

// DeepSeek-V3: <｜begin▁of▁sentence｜> at bos_id, <｜end▁of▁sentence｜> at eos_id (DeepSeek's 0 and 1), the chat
// markers (<｜User｜>, <｜Assistant｜>, <think>, </think>, the tool call and tool output markers, <｜▁pad▁｜>) at the
// top of the vocabulary, the ranks in the ids between.
TokenizerFileLayout deepseek_v3_tokenizer_layout(int64_t vocab_size, int32_t bos_id, int32_t eos_id);

// Byte-level BPE training: pre-tokenize `corpus` with `pattern`, then repeatedly merge the most frequent adjacent
// pair (ties: the smaller merged bytes). Returns up to `n_merges` new tokens in rank order; fewer when the corpus
// runs out of pairs.
std::vector<std::string> train_bpe_merges(std::string_view corpus, std::string_view pattern, size_t n_merges);

// The embedded training text (English prose and code).
std::string_view tokenizer_training_corpus();

// Writes <dir>/tiktoken.model and <dir>/tokenizer_config.json for `layout` (merges trained on the embedded corpus
// with the Kimi pattern, then deterministic filler tokens should the corpus run out of pairs).
void write_tokenizer_files(const std::filesystem::path& dir, const TokenizerFileLayout& layout);

// make-random: the tokenizer files of a final config.json of `arch` ("kimi_k3": text_config.vocab_size;
// "deepseek_v3": vocab_size, bos_token_id, eos_token_id). Throws bg::Error for another arch.
void write_random_tokenizer(const std::string& arch, const nlohmann::json& config, const std::filesystem::path& dir);

}  // namespace bg
