// The tokenizer files make-random writes: Kimi's formats, the K3 control slots at their real offsets, a trained
// vocabulary that Tokenizer::load reads back and that round-trips text; the DeepSeek-V3 layout; BPE training.
#include <gtest/gtest.h>

#include "core/error.h"
#include "server/tokenizer/tokenizer.h"
#include "server/tokenizer/tokenizer_writer.h"
#include "temp_dir.h"

namespace bg {
namespace {

TEST(TokenizerWriter, KimiTinyVocabulary) {
  testing::TempDir dir;
  write_tokenizer_files(dir.path(), kimi_tokenizer_layout(1024));
  Tokenizer tok = Tokenizer::load(dir.path());
  EXPECT_EQ(tok.vocab_size(), 1024);
  for (int32_t id = 0; id < 1024; ++id) EXPECT_TRUE(tok.is_known(id)) << id;
  EXPECT_EQ(tok.bos_id(), 768);  // V-256, as make-random's config.json says
  EXPECT_EQ(tok.eos_id(), 769);
  EXPECT_EQ(tok.pad_id(), 1023);
  EXPECT_EQ(tok.special_id("<|end_of_msg|>"), 770);  // V-254: config.json's eos_token_id
  EXPECT_EQ(tok.special_id("<|open|>"), 771);
  EXPECT_EQ(tok.special_id("<|close|>"), 772);
  EXPECT_EQ(tok.special_id("<|sep|>"), 773);
  EXPECT_EQ(tok.special_id("<|media_pad|>"), 789);  // V-235: media_placeholder_token_id
  EXPECT_EQ(tok.special_id("[UNK]"), 1022);
  EXPECT_EQ(tok.special_id("<|reserved_token_800|>"), 800);
  const std::string text = "The engine reads a request and returns the answer. 你好 🚀 1234";
  const auto ids = tok.encode(text);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_LT(ids.size(), text.size() / 2);  // merges were learned: common English compresses
  // Deterministic: the same files every time.
  testing::TempDir again;
  write_tokenizer_files(again.path(), kimi_tokenizer_layout(1024));
  EXPECT_EQ(Tokenizer::load(again.path()).encode(text), ids);
}

TEST(TokenizerWriter, DeepSeekLayoutAndLargeVocabularies) {
  testing::TempDir dir;
  write_tokenizer_files(dir.path(), deepseek_v3_tokenizer_layout(512, 0, 1));
  Tokenizer tok = Tokenizer::load(dir.path());
  EXPECT_EQ(tok.vocab_size(), 512);
  EXPECT_EQ(tok.bos_id(), 0);
  EXPECT_EQ(tok.eos_id(), 1);
  EXPECT_EQ(tok.pad_id(), 2);
  EXPECT_TRUE(tok.is_hf());                               // tokenizer.json, as DeepSeek ships
  EXPECT_EQ(tok.special_id("<｜User｜>"), 512 - 13);      // the 13 chat markers at the top
  EXPECT_TRUE(tok.is_control(512 - 13));
  EXPECT_FALSE(tok.is_special(512 - 13));                 // "special": false, as in DeepSeek's file
  EXPECT_TRUE(tok.is_special(0));
  EXPECT_EQ(tok.decode(tok.encode("hello world")), "hello world");
  EXPECT_EQ(tok.with_template(std::vector<int32_t>{7}), (std::vector<int32_t>{0, 7}));  // BOS from the post-processor
  // A vocabulary larger than the corpus can fill is completed with filler merges.
  testing::TempDir big_ds;
  write_tokenizer_files(big_ds.path(), deepseek_v3_tokenizer_layout(6000, 0, 1));
  const Tokenizer big_tok = Tokenizer::load(big_ds.path());
  EXPECT_EQ(big_tok.vocab_size(), 6000);
  EXPECT_EQ(big_tok.decode(big_tok.encode("zq~~ filler ^^ tokens")), "zq~~ filler ^^ tokens");
  // A vocabulary larger than the corpus can fill is completed with filler tokens.
  testing::TempDir big;
  write_tokenizer_files(big.path(), kimi_tokenizer_layout(20000));
  EXPECT_EQ(Tokenizer::load(big.path()).vocab_size(), 20000);
  EXPECT_THROW(kimi_tokenizer_layout(400), Error);
  EXPECT_THROW(deepseek_v3_tokenizer_layout(512, 5, 1), Error);
}

TEST(TokenizerWriter, KimiK2Layout) {
  testing::TempDir dir;
  write_tokenizer_files(dir.path(), kimi_k2_tokenizer_layout(1024));
  const Tokenizer tok = Tokenizer::load(dir.path());
  EXPECT_EQ(tok.bos_id(), 768);
  EXPECT_EQ(tok.eos_id(), 769);
  EXPECT_EQ(tok.special_id("<|im_end|>"), 770);
  EXPECT_EQ(tok.special_id("<|im_system|>"), 778);
  EXPECT_EQ(tok.special_id("<|tool_calls_section_begin|>"), 779);
  EXPECT_EQ(tok.special_id("<|im_middle|>"), 785);
  EXPECT_EQ(tok.special_id("<think>"), 790);
  EXPECT_FALSE(tok.special_id("<|open|>").has_value());  // K3's markers are not K2's
  EXPECT_EQ(kimi_k2_config_patch(512)["vocab_size"], 1024);
  EXPECT_EQ(kimi_k2_config_patch(512)["eos_token_id"], 769);
}

TEST(TokenizerWriter, BpeTrainingMergesMostFrequentPairs) {
  const auto merges = train_bpe_merges("aaa aaa aaa ab", kKimiPattern, 3);
  ASSERT_GE(merges.size(), 2u);
  EXPECT_EQ(merges[0], "aa");
  EXPECT_EQ(merges[1], "aaa");
}

}  // namespace
}  // namespace bg
