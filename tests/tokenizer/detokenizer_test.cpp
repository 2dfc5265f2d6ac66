// IncrementalDetokenizer and Utf8Assembler: code points split across tokens, specials, and U+FFFD only at flush or
// for sequences that are provably ill-formed.
#include <gtest/gtest.h>

#include "tokenizer/tokenizer_testing.h"

namespace bg {
namespace {

std::string run(IncrementalDetokenizer& d, const std::vector<int32_t>& ids, std::vector<std::string>* pieces = nullptr) {
  std::string out;
  for (int32_t id : ids) {
    std::string p = d.push(id);
    if (pieces) pieces->push_back(p);
    out += p;
  }
  return out;
}

const std::string kFffd = "\xEF\xBF\xBD";

TEST(IncrementalDetokenizer, EmojiSplitAcrossByteTokens) {
  Tokenizer t = testing::small_tokenizer({});
  IncrementalDetokenizer d(t);
  const std::string rocket = "\xF0\x9F\x9A\x80";  // U+1F680, four byte tokens
  std::vector<std::string> pieces;
  std::vector<int32_t> ids;
  for (unsigned char b : "a" + rocket + "b") ids.push_back(b);
  EXPECT_EQ(run(d, ids, &pieces), "a" + rocket + "b");
  EXPECT_EQ(pieces, (std::vector<std::string>{"a", "", "", "", rocket, "b"}));
  EXPECT_EQ(d.flush(), "");
}

TEST(IncrementalDetokenizer, CjkSplitInsideMergedTokens) {
  // "中" = E4 B8 AD, "文" = E6 96 87; tokens that cut through both code points.
  Tokenizer t = testing::small_tokenizer({"\xE4\xB8", "\xAD\xE6", "\x96\x87"});
  IncrementalDetokenizer d(t);
  std::vector<std::string> pieces;
  EXPECT_EQ(run(d, {256, 257, 258}, &pieces), "中文");
  EXPECT_EQ(pieces, (std::vector<std::string>{"", "中", "文"}));
}

TEST(IncrementalDetokenizer, InvalidSequences) {
  Tokenizer t = testing::small_tokenizer({});
  {
    IncrementalDetokenizer d(t);
    EXPECT_EQ(d.push(0xE4), "");  // could still complete
    EXPECT_EQ(d.push(0xB8), "");
    EXPECT_EQ(d.push('x'), kFffd + "x");  // now provably ill-formed: one U+FFFD for the maximal subpart E4 B8
  }
  {
    IncrementalDetokenizer d(t);
    EXPECT_EQ(d.push(0x80), kFffd);  // a lone continuation byte is ill-formed at once
    EXPECT_EQ(d.push(0xFF), kFffd);
    EXPECT_EQ(d.push(0xC0), kFffd);  // overlong lead
    EXPECT_EQ(d.push(0xED), "");
    EXPECT_EQ(d.push(0xA0), kFffd + kFffd);  // surrogate: ED then A0 are each ill-formed
  }
  {
    IncrementalDetokenizer d(t);
    EXPECT_EQ(d.push(0xF0), "");
    EXPECT_EQ(d.push(0x9F), "");
    EXPECT_EQ(d.flush(), kFffd);  // an unfinished sequence at the end
    EXPECT_EQ(d.flush(), "");
  }
}

TEST(IncrementalDetokenizer, SpecialTokens) {
  Tokenizer t = testing::small_tokenizer({}, {{"<|sep|>", 256}});
  IncrementalDetokenizer skip(t);
  EXPECT_EQ(run(skip, {'a', 0xC3, 256, 0xA9, 'b'}), "aéb");  // skipped specials are transparent
  IncrementalDetokenizer keep(t, /*skip_special=*/false);
  EXPECT_EQ(run(keep, {'a', 256, 'b'}), "a<|sep|>b");
  EXPECT_EQ(run(keep, {0xC3, 256}), kFffd + "<|sep|>");
  IncrementalDetokenizer unknown(t);
  EXPECT_EQ(run(unknown, {'a', 0xC3, 9999, 'b'}), "a" + kFffd + kFffd + "b");
}

TEST(Utf8, SanitizeAndValidate) {
  EXPECT_EQ(sanitize_utf8("ok é 中 🚀"), "ok é 中 🚀");
  EXPECT_TRUE(is_valid_utf8("ok é 中 🚀"));
  EXPECT_FALSE(is_valid_utf8("\xF0\x90\x80"));
  EXPECT_FALSE(is_valid_utf8("\xF0\x90\x80" "A"));
  EXPECT_EQ(sanitize_utf8("\xF0\x90\x80" "A"), kFffd + "A");
  EXPECT_EQ(sanitize_utf8("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);  // > U+10FFFF
  EXPECT_EQ(sanitize_utf8("\xE0\x80\x80"), kFffd + kFffd + kFffd);              // overlong
}

}  // namespace
}  // namespace bg
