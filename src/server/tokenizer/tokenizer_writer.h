// Tokenizer files for random-weight checkpoints: a deterministic byte-level BPE vocabulary (256 bytes + merges trained
// on a small embedded English/code corpus) with the model family's special tokens, written in the family's real
// format (Kimi: tiktoken.model + tokenizer_config.json; DeepSeek-V3: Hugging Face tokenizer.json +
// tokenizer_config.json with a chat_template) so Tokenizer::load and the chat formats work on `make-random` output.
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
  std::vector<std::string> not_special;  // added tokens written "special": false (DeepSeek's chat markers)
  std::string bos, eos, pad, unk;         // names of specials ("" = none)
  bool hf = false;                        // write tokenizer.json (Hugging Face) instead of tiktoken.model
  std::string chat_template;              // written into tokenizer_config.json when not empty
};

// Kimi K2/K3: ranks 0..V-257, the 256 control slots V-256..V-1 with K3's names at their real offsets ([BOS] +0,
// [EOS] +1, <|end_of_msg|> +2, <|open|> +3, <|close|> +4, <|sep|> +5, ..., [UNK] +254, [PAD] +255) and
// "<|reserved_token_<id>|>" elsewhere. Throws bg::Error when V < 513 (no room for 256 bytes + 256 slots).
TokenizerFileLayout kimi_tokenizer_layout(int64_t vocab_size);

// Kimi K2: the same 256 control slots with K2's names ([BOS] +0, [EOS] +1, <|im_end|> +2, <|im_user|> +3,
// <|im_assistant|> +4, <|im_system|> +10, the tool-call section markers +11..+15, <|im_middle|> +17, <think> +22,
// </think> +23, ...). Throws bg::Error when V < 513.
TokenizerFileLayout kimi_k2_tokenizer_layout(int64_t vocab_size);

// DeepSeek-V3 (tokenizer.json): <｜begin▁of▁sentence｜> 0, <｜end▁of▁sentence｜> 1, <｜▁pad▁｜> 2 (special, also in the
// model vocabulary, as DeepSeek's file has them), the BPE tokens from 3, and the chat markers (<｜User｜>,
// <｜Assistant｜>, <think>, </think>, the tool call / tool output markers; "special": false) at the top.
TokenizerFileLayout deepseek_v3_tokenizer_layout(int64_t vocab_size, int32_t bos_id, int32_t eos_id);

// DeepSeek-V3's pre-tokenizer as one pattern (digit groups, CJK runs, then its main split; used to train merges).
std::string_view deepseek_v3_training_pattern();

// Byte-level BPE training: pre-tokenize `corpus` with `pattern`, then repeatedly merge the most frequent adjacent
// pair (ties: the smaller merged bytes). Returns up to `n_merges` new tokens in rank order; fewer when the corpus
// runs out of pairs.
std::vector<std::string> train_bpe_merges(std::string_view corpus, std::string_view pattern, size_t n_merges);
// The same training, returning each merge as its (left, right) token bytes.
std::vector<std::pair<std::string, std::string>> train_bpe_pairs(std::string_view corpus, std::string_view pattern,
                                                                 size_t n_merges);

// The embedded training text (English prose and code).
std::string_view tokenizer_training_corpus();

// Writes <dir>/tiktoken.model (or, for a layout with `hf`, <dir>/tokenizer.json) and <dir>/tokenizer_config.json
// for `layout` (merges trained on the embedded corpus, then deterministic filler tokens should the corpus run out).
void write_tokenizer_files(const std::filesystem::path& dir, const TokenizerFileLayout& layout);
void write_hf_tokenizer_files(const std::filesystem::path& dir, const TokenizerFileLayout& layout);

// make-random: the tokenizer files of a final config.json of `arch` ("kimi_k3": text_config.vocab_size;
// "deepseek_v3": vocab_size, bos_token_id, eos_token_id, model_type). `chat_template` picks the template layout
// written into tokenizer_config.json for deepseek_v3 ("deepseek_v3", "deepseek_v3.1" (default), "kimi_k2": then
// Kimi-K2's tiktoken files; the config must be model_type kimi_k2 with K2's bos/eos ids, see
// kimi_k2_config_patch). Throws bg::Error for another arch or layout.
void write_random_tokenizer(const std::string& arch, const nlohmann::json& config, const std::filesystem::path& dir,
                            const std::string& chat_template = "");
// The config.json changes a deepseek_v3 checkpoint needs for the kimi_k2 layout: model_type kimi_k2, a vocabulary of
// at least 1024 (room for K2's 256 control slots) and K2's bos/eos ids.
nlohmann::json kimi_k2_config_patch(int64_t vocab_size);

}  // namespace bg
