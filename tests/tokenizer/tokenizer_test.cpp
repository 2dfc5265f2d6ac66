// Tokenizer unit tests: BPE merge order, the Kimi pre-tokenizer pieces, special tokens, loading tiktoken.model +
// tokenizer_config.json (and rejecting bad files), round trips over random bytes, and long-run performance.
#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "core/error.h"
#include "server/tokenizer/base64.h"
#include "server/tokenizer/regex.h"
#include "temp_dir.h"
#include "tokenizer/tokenizer_testing.h"

namespace bg {
namespace {

using testing::small_tokenizer;
using testing::TempDir;
using testing::write_text_file;

std::vector<std::string> split(std::string_view pattern, std::string_view text) {
  Regex re{std::string(pattern), Regex::Mode::kUnicode, "test pattern"};
  std::vector<std::string> pieces;
  re.for_each_match(text, [&](size_t b, size_t e) { pieces.emplace_back(text.substr(b, e - b)); });
  return pieces;
}

using Pieces = std::vector<std::string>;

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// The negated classes of kKimiPattern match exactly the code points of the original's class intersections.
TEST(KimiPattern, NegatedClassesEqualTheIntersections) {
  std::string all;
  for (uint32_t cp = 1; cp <= 0x10FFFF; ++cp) {
    if (cp < 0xD800 || cp > 0xDFFF) append_utf8(all, cp);
  }
  auto starts = [&](const char* cls) {
    std::vector<size_t> out;
    Regex{cls, Regex::Mode::kUnicode, "class"}.for_each_match(all, [&](size_t b, size_t) { out.push_back(b); });
    return out;
  };
  const auto upper = starts(R"((?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]))");
  EXPECT_GT(upper.size(), 30000u);  // Hangul, kana, Latin, ... (most Lo are Han)
  EXPECT_EQ(upper, starts(R"([^\p{Han}\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}])"));
  EXPECT_EQ(starts(R"((?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}]))"), starts(R"([^\p{Han}\p{Lu}\p{Lt}\p{N}\p{P}\p{S}\p{Z}\p{C}])"));
}

TEST(KimiPattern, HanRunsAreTheirOwnPieces) {
  EXPECT_EQ(split(kKimiPattern, "中文English混合"), (Pieces{"中文", "English", "混合"}));
  EXPECT_EQ(split(kKimiPattern, "汉字abc"), (Pieces{"汉字", "abc"}));
  EXPECT_EQ(split(kKimiPattern, "北京市 Pascal"), (Pieces{"北京市", " Pascal"}));
  // Kana are letters but not Han: they join a letter run, Han splits off.
  EXPECT_EQ(split(kKimiPattern, "ひらがな漢字カタカナ"), (Pieces{"ひらがな", "漢字", "カタカナ"}));
  // o200k has no Han rule: the same text is one letter run there.
  EXPECT_EQ(split(kO200kPattern, "中文English混合"), (Pieces{"中文English混合"}));
}

TEST(KimiPattern, Contractions) {
  EXPECT_EQ(split(kKimiPattern, "I'm you're they'VE DON'T"), (Pieces{"I'm", " you're", " they'VE", " DON'T"}));
  EXPECT_EQ(split(kKimiPattern, "dog'll we'd it's"), (Pieces{"dog'll", " we'd", " it's"}));
  // Not a contraction: the apostrophe starts a punctuation piece.
  EXPECT_EQ(split(kKimiPattern, "x'yz"), (Pieces{"x", "'yz"}));
}

TEST(KimiPattern, DigitsInGroupsOfAtMostThree) {
  EXPECT_EQ(split(kKimiPattern, "1234567"), (Pieces{"123", "456", "7"}));
  EXPECT_EQ(split(kKimiPattern, "a 12345"), (Pieces{"a", " ", "123", "45"}));
  EXPECT_EQ(split(kKimiPattern, "٣٤٥٦"), (Pieces{"٣٤٥", "٦"}));
}

TEST(KimiPattern, CaseRunsPunctuationAndWhitespace) {
  EXPECT_EQ(split(kKimiPattern, "HTTPServer camelCase"), (Pieces{"HTTPServer", " camel", "Case"}));
  EXPECT_EQ(split(kKimiPattern, "a  b"), (Pieces{"a", " ", " b"}));
  EXPECT_EQ(split(kKimiPattern, "x;\n\ny"), (Pieces{"x", ";\n\n", "y"}));
  EXPECT_EQ(split(kKimiPattern, "x \n  y"), (Pieces{"x", " \n", " ", " y"}));
  EXPECT_EQ(split(kKimiPattern, "end   "), (Pieces{"end", "   "}));
}

TEST(Tokenizer, MergesByLowestRankLeftmostFirst) {
  // "ab" (256) before "bc" (257): "abc" -> [ab, c]; with "abc" (258) it then merges to one token.
  Tokenizer t = small_tokenizer({"ab", "bc"});
  EXPECT_EQ(t.encode("abc"), (std::vector<int32_t>{256, 'c'}));
  Tokenizer t2 = small_tokenizer({"bc", "ab"});
  EXPECT_EQ(t2.encode("abc"), (std::vector<int32_t>{'a', 256}));
  Tokenizer t3 = small_tokenizer({"ab", "bc", "abc"});
  EXPECT_EQ(t3.encode("abc"), (std::vector<int32_t>{258}));
  // Equal pairs: the leftmost merges first ("aaa" -> [aa, a]).
  Tokenizer t4 = small_tokenizer({"aa"});
  EXPECT_EQ(t4.encode("aaa"), (std::vector<int32_t>{256, 'a'}));
  EXPECT_EQ(t4.encode("aaaa"), (std::vector<int32_t>{256, 256}));
}

TEST(Tokenizer, SpecialTokensPlainOrSpecial) {
  Tokenizer t = small_tokenizer({"<|", "|>"}, {{"<|open|>", 300}, {"<|open|>x", 301}, {"[EOS]", 302}});
  EXPECT_EQ(t.special_id("<|open|>"), 300);
  EXPECT_FALSE(t.special_id("<|nope|>").has_value());
  EXPECT_TRUE(t.is_special(302));
  EXPECT_FALSE(t.is_special('a'));
  EXPECT_EQ(t.vocab_size(), 303);
  // Plain: the characters are ordinary text.
  const std::vector<int32_t> plain = t.encode("<|open|>");
  EXPECT_EQ(t.decode(plain), "<|open|>");
  for (int32_t id : plain) EXPECT_FALSE(t.is_special(id));
  // With specials: the longest special at a position wins; text around them is BPE'd.
  EXPECT_EQ(t.encode_with_special("a<|open|>xb[EOS]"), (std::vector<int32_t>{'a', 301, 'b', 302}));
  EXPECT_EQ(t.encode_with_special("<|open|>y"), (std::vector<int32_t>{300, 'y'}));
  EXPECT_EQ(t.decode(std::vector<int32_t>{300, 'y'}), "<|open|>y");
  EXPECT_THROW(t.token_bytes(299), Error);  // a gap in the ids
  EXPECT_THROW(t.token_bytes(-1), Error);
  EXPECT_THROW(t.decode(std::vector<int32_t>{5000}), Error);
}

TEST(Tokenizer, FromRanksRejectsInconsistentInput) {
  auto ranks = testing::byte_ranks({"ab"});
  ranks.emplace_back("ab", 400);
  EXPECT_THROW(Tokenizer::from_ranks(ranks, {std::string(kKimiPattern), {}}), Error);
  EXPECT_THROW(Tokenizer::from_ranks(testing::byte_ranks({}), {std::string(kKimiPattern), {{"[X]", 65}}}), Error);
  EXPECT_THROW(Tokenizer::from_ranks(testing::byte_ranks({}), {"([unclosed", {}}), Error);
}

TEST(Tokenizer, RandomBytesRoundTrip) {
  Tokenizer t = small_tokenizer({"th", "he", "the", " t", "in", "  ", "\xE4\xB8", "\xF0\x9F"});
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    std::string s(rng() % 64, '\0');
    for (char& c : s) c = static_cast<char>(rng() % 256);  // mostly invalid UTF-8
    EXPECT_EQ(t.decode(t.encode(s)), s);
    EXPECT_EQ(t.decode(t.encode_with_special(s)), s);
  }
}

TEST(Tokenizer, LongWhitespaceRunIsFast) {
  std::vector<std::string> merges;
  for (int n = 2; n <= 64; n *= 2) merges.emplace_back(static_cast<size_t>(n), ' ');
  Tokenizer t = small_tokenizer(merges);
  const std::string run(100 * 1024, ' ');
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = t.encode(run + "x");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(t.decode(ids), run + "x");
  EXPECT_LT(seconds, 2.0);
  const std::string letters(100 * 1024, 'a');  // one long letter piece
  EXPECT_EQ(t.decode(t.encode(letters)), letters);
}

TEST(Base64, RoundTripAndStrictness) {
  for (std::string s : {"", "a", "ab", "abc", "abcd", "\xff\x00\x10"}) {
    EXPECT_EQ(base64_decode(base64_encode(s)), s);
  }
  EXPECT_FALSE(base64_decode("YQ=").has_value());
  EXPECT_FALSE(base64_decode("Y=Q=").has_value());
  EXPECT_FALSE(base64_decode("YQ==YQ==").has_value());
  EXPECT_FALSE(base64_decode("Y!==").has_value());
}

// ---- Tokenizer::load ----------------------------------------------------------------------------------------

std::string model_text(int n_merges) {
  std::string text;
  for (int b = 0; b < 256; ++b) text += base64_encode(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  const char* merges[] = {"ab", "cd", "abcd"};
  for (int i = 0; i < n_merges; ++i) text += base64_encode(merges[i]) + " " + std::to_string(256 + i) + "\n";
  return text;
}

const char* kConfig = R"({
  "added_tokens_decoder": {
    "259": {"content": "[BOS]", "special": true},
    "260": {"content": "[EOS]", "special": true},
    "261": {"content": "<|end_of_msg|>", "special": true},
    "264": {"content": "[PAD]", "special": true}
  },
  "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}, "pad_token": "[PAD]", "unk_token": null
})";

TEST(TokenizerLoad, ReadsRanksSpecialsAndReservedSlots) {
  TempDir dir;
  write_text_file(dir / "tiktoken.model", model_text(3));
  write_text_file(dir / "tokenizer_config.json", kConfig);
  Tokenizer t = Tokenizer::load(dir.path());
  EXPECT_EQ(t.vocab_size(), 265);
  EXPECT_EQ(t.bos_id(), 259);
  EXPECT_EQ(t.eos_id(), 260);
  EXPECT_EQ(t.pad_id(), 264);
  EXPECT_EQ(t.special_id("<|end_of_msg|>"), 261);
  // The unnamed control slots between get Kimi's reserved names.
  EXPECT_EQ(t.special_id("<|reserved_token_262|>"), 262);
  EXPECT_EQ(t.token_bytes(263), "<|reserved_token_263|>");
  EXPECT_EQ(t.encode("abcd"), (std::vector<int32_t>{258}));
  EXPECT_EQ(t.pattern(), kKimiPattern);
}

void expect_load_error(const std::string& model, const std::string& config, const std::string& needle) {
  TempDir dir;
  if (!model.empty()) write_text_file(dir / "tiktoken.model", model);
  if (!config.empty()) write_text_file(dir / "tokenizer_config.json", config);
  try {
    Tokenizer::load(dir.path());
    ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(TokenizerLoad, RejectsBadFiles) {
  const std::string good = model_text(3);
  expect_load_error("", kConfig, "neither tokenizer.json (Hugging Face) nor tiktoken.model (Kimi)");
  expect_load_error(good, "", "tokenizer_config.json: cannot open");
  expect_load_error(good + "!!!! 300\n", kConfig, "tiktoken.model:260: bad base64");
  expect_load_error(good + "eHl6 12a\n", kConfig, "tiktoken.model:260: rank '12a'");
  expect_load_error(good + "eHl6 -3\n", kConfig, "tiktoken.model:260: rank '-3'");
  expect_load_error(good + "YWI= 300\n", kConfig, "tiktoken.model:260: duplicate token 'YWI=' (also on line 257)");
  expect_load_error(good + "eHl6 5\n", kConfig, "tiktoken.model:260: duplicate rank 5 (also on line 6)");
  expect_load_error(good + "eHl6\n", kConfig, "tiktoken.model:260: expected 'base64-token rank'");
  expect_load_error(good, "[1, 2]", "not a JSON object");
  expect_load_error(good, R"({"added_tokens_decoder": {"x": {"content": "[A]"}}})", "key 'x' is not a token id");
  expect_load_error(good, R"({"added_tokens_decoder": {"300": {"special": true}}})", "needs a string 'content'");
  expect_load_error(good, R"({"added_tokens_decoder": {"5": {"content": "[A]"}}})", "reuses id 5");
  expect_load_error(good, R"({"bos_token": "[NOPE]"})", "bos_token '[NOPE]'");
}

}  // namespace
}  // namespace bg
