// Hugging Face tokenizer.json: pair merges (not tiktoken's rank-of-bytes rule), both merge encodings, added tokens
// (special / not special, lstrip / rstrip / single_word, normalized), normalizers, Split behaviours, ByteLevel options,
// the post-processor template, every validation error; and ids / decoded text equal to @huggingface/tokenizers on the
// corpus over make-random's DeepSeek-V3-layout tokenizer.json (fixture hf_reference).
#include <gtest/gtest.h>

#include <fstream>

#include "core/error.h"
#include "server/tokenizer/hf_pipeline.h"
#include "server/tokenizer/tokenizer.h"
#include "temp_dir.h"

namespace bg {
namespace {

using nlohmann::json;

std::string bl(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) out += byte_level_chars()[b];
  return out;
}

// A byte-level tokenizer.json: the 256 bytes at ids 0..255, then one token per merge in order.
json tiny_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges, bool string_merges = true) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[bl(std::string(1, static_cast<char>(b)))] = b;
  json m = json::array();
  int next = 256;
  for (const auto& [a, b] : merges) {
    m.push_back(string_merges ? json(bl(a) + " " + bl(b)) : json::array({bl(a), bl(b)}));
    if (!vocab.contains(bl(a + b))) vocab[bl(a + b)] = next++;
  }
  return {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", m}}},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"added_tokens", json::array()}};
}

Tokenizer make(const json& j) { return Tokenizer::from_hf_json(j, json(), "tokenizer.json"); }

std::string error_of(const json& j, const std::string& text = "") {
  try {
    make(j).encode_with_special(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(HfTokenizer, PairMergesNotRankOfBytes) {
  // (b c) first; then (a bc) is no merge even though "abc" is a token (made from (ab c)): HF gives [a, bc] where
  // tiktoken's rule would give [abc].
  const json j = tiny_tokenizer({{"b", "c"}, {"a", "b"}, {"ab", "c"}});
  const Tokenizer tok = make(j);
  const int32_t bc = 256, ab = 257, abc = 258;
  EXPECT_EQ(tok.encode("abc"), (std::vector<int32_t>{'a', bc}));
  EXPECT_EQ(tok.encode("abx"), (std::vector<int32_t>{ab, 'x'}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{abc}), "abc");
  EXPECT_EQ(make(tiny_tokenizer({{"b", "c"}, {"a", "b"}, {"ab", "c"}}, false)).encode("abc abx"), tok.encode("abc abx"));
}

TEST(HfTokenizer, LeftmostOnEqualRanksAndIgnoreMerges) {
  json j = tiny_tokenizer({{"a", "a"}, {"aa", "aa"}});
  const Tokenizer tok = make(j);
  EXPECT_EQ(tok.encode("aaaaa"), (std::vector<int32_t>{257, 'a'}));  // aa|aa|a -> aaaa|a
  j["model"]["vocab"][bl("aaa")] = 300;
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(make(j).encode("aaa"), std::vector<int32_t>{300});  // a whole-word token wins with ignore_merges
}

TEST(HfTokenizer, AddedTokensSpecialAndNot) {
  json j = tiny_tokenizer({});
  j["added_tokens"] = json::array({
      {{"id", 300}, {"content", "<s>"}, {"special", true}},
      {{"id", 301}, {"content", "<U>"}, {"special", false}},
      {{"id", 302}, {"content", "<L>"}, {"special", true}, {"lstrip", true}, {"rstrip", true}},
      {{"id", 303}, {"content", "W"}, {"special", true}, {"single_word", true}},
  });
  const Tokenizer tok = make(j);
  EXPECT_EQ(tok.encode_with_special("<s>x<U>"), (std::vector<int32_t>{300, 'x', 301}));
  EXPECT_EQ(tok.encode("<s>x<U>"), (std::vector<int32_t>{'<', 's', '>', 'x', 301}));  // specials as text
  EXPECT_EQ(tok.encode_with_special("a  <L>\t b"), (std::vector<int32_t>{'a', 302, 'b'}));  // whitespace absorbed
  EXPECT_EQ(tok.encode_with_special("W xW W"), (std::vector<int32_t>{303, ' ', 'x', 'W', ' ', 303}));
  EXPECT_TRUE(tok.is_special(300));
  EXPECT_FALSE(tok.is_special(301));
  EXPECT_TRUE(tok.is_control(301));
  EXPECT_EQ(tok.special_id("<U>"), 301);
  EXPECT_EQ(tok.decode(std::vector<int32_t>{'a', 301}), "a<U>");
}

TEST(HfTokenizer, Normalizers) {
  json j = tiny_tokenizer({});
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers",
                      {{{"type", "NFKC"}},
                       {{"type", "Lowercase"}},
                       {{"type", "Replace"}, {"pattern", {{"String", "x"}}}, {"content", "y"}},
                       {{"type", "Strip"}, {"strip_left", true}, {"strip_right", false}},
                       {{"type", "Prepend"}, {"prepend", "_"}}}}};
  const Tokenizer tok = make(j);
  EXPECT_EQ(tok.decode(tok.encode("  ﬁX\u00C5")), "_fiy\u00E5");
  json nfc = tiny_tokenizer({});
  nfc["normalizer"] = {{"type", "NFC"}};
  EXPECT_EQ(make(nfc).decode(make(nfc).encode("e\u0301")), "\u00E9");
  nfc["normalizer"] = {{"type", "BertNormalizer"}};
  EXPECT_NE(error_of(nfc).find("unsupported normalizer type 'BertNormalizer'"), std::string::npos);
}

std::vector<std::string> pre_tokenize(const json& p, std::string text) {
  std::vector<std::string> pieces{std::move(text)};
  parse_hf_pre_tokenizer(p, "pre")->apply(pieces);
  return pieces;
}

TEST(HfTokenizer, SplitBehaviours) {
  auto split = [](const char* behavior, bool invert = false) {
    return json{{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", invert}};
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pre_tokenize(split("Removed"), "a-b--c"), (V{"a", "b", "c"}));
  EXPECT_EQ(pre_tokenize(split("Isolated"), "a-b--c"), (V{"a", "-", "b", "-", "-", "c"}));
  EXPECT_EQ(pre_tokenize(split("MergedWithPrevious"), "a-b--c"), (V{"a-", "b-", "-", "c"}));
  EXPECT_EQ(pre_tokenize(split("MergedWithNext"), "a-b--c"), (V{"a", "-b", "-", "-c"}));
  EXPECT_EQ(pre_tokenize(split("Contiguous"), "a-b--c"), (V{"a", "-", "b", "--", "c"}));
  EXPECT_EQ(pre_tokenize(split("Removed", true), "a-b--c"), (V{"-", "-", "-"}));
  EXPECT_EQ(pre_tokenize({{"type", "Digits"}, {"individual_digits", false}}, "ab123c4"), (V{"ab", "123", "c", "4"}));
  EXPECT_EQ(pre_tokenize({{"type", "Digits"}, {"individual_digits", true}}, "a12"), (V{"a", "1", "2"}));
  EXPECT_EQ(pre_tokenize({{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}}, "hi there"),
            (V{" hi", " there"}));
  EXPECT_THROW(pre_tokenize({{"type", "Split"}, {"pattern", {{"Regex", "("}}}, {"behavior", "Isolated"}}, "x"), Error);
  EXPECT_THROW(pre_tokenize({{"type", "Metaspace"}}, "x"), Error);
}

TEST(HfTokenizer, PostProcessorTemplate) {
  json j = tiny_tokenizer({});
  j["added_tokens"] = json::array({{{"id", 300}, {"content", "<bos>"}, {"special", true}}});
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<bos>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"special_tokens", {{"<bos>", {{"id", "<bos>"}, {"ids", {300}}, {"tokens", {"<bos>"}}}}}}};
  EXPECT_EQ(make(j).with_template(std::vector<int32_t>{'a'}), (std::vector<int32_t>{300, 'a'}));
  j["post_processor"]["single"][0]["SpecialToken"]["id"] = "<missing>";
  EXPECT_NE(error_of(j).find("special token '<missing>' is not in"), std::string::npos);
}

// LlamaTokenizerFast (DeepSeek-V3's tokenizer_class) rebuilds the template from add_bos_token (default true) and
// add_eos_token (default false), as transformers does when it loads; other classes keep tokenizer.json's.
TEST(HfTokenizer, LlamaConfigFlagsReplaceThePostProcessor) {
  json j = tiny_tokenizer({});
  j["added_tokens"] = json::array({{{"id", 300}, {"content", "<bos>"}, {"special", true}},
                                   {{"id", 301}, {"content", "<eos>"}, {"special", true}}});
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<bos>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"special_tokens", {{"<bos>", {{"id", "<bos>"}, {"ids", {300}}, {"tokens", {"<bos>"}}}}}}};
  json config = {{"bos_token", "<bos>"}, {"eos_token", "<eos>"}, {"tokenizer_class", "LlamaTokenizerFast"}};
  const std::vector<int32_t> a{'a'};
  auto with = [&](const json& c) { return Tokenizer::from_hf_json(j, c, "tokenizer.json").with_template(a); };
  EXPECT_EQ(with(config), (std::vector<int32_t>{300, 'a'}));  // the defaults: BOS, no EOS
  config["add_bos_token"] = false;
  EXPECT_EQ(with(config), a);
  config["add_eos_token"] = true;
  EXPECT_EQ(with(config), (std::vector<int32_t>{'a', 301}));
  config["tokenizer_class"] = "PreTrainedTokenizerFast";  // not Llama's: tokenizer.json's template stands
  EXPECT_EQ(with(config), (std::vector<int32_t>{300, 'a'}));
  config["tokenizer_class"] = "LlamaTokenizerFast";
  config["add_bos_token"] = "yes";
  EXPECT_THROW(with(config), Error);
  config["add_bos_token"] = true;
  config.erase("bos_token");
  EXPECT_THROW(with(config), Error);  // asks for a BOS it does not name
}

TEST(HfTokenizer, ValidationErrorsNameTheField) {
  json j = tiny_tokenizer({{"a", "b"}});
  j["model"]["merges"].push_back(bl("q") + " " + bl("zz"));
  EXPECT_NE(error_of(j).find("merges[1]: \"zz\" is not in the vocabulary"), std::string::npos) << error_of(j);
  j = tiny_tokenizer({});
  j["model"]["vocab"].erase(bl("A"));
  EXPECT_NE(error_of(j).find("no token for byte 0x41"), std::string::npos) << error_of(j);
  j = tiny_tokenizer({});
  j["model"]["vocab"]["dup"] = 5;
  EXPECT_NE(error_of(j).find("share id 5"), std::string::npos) << error_of(j);
  j = tiny_tokenizer({});
  j["added_tokens"] = json::array({{{"id", 65}, {"content", "<x>"}}});
  EXPECT_NE(error_of(j).find("which the vocabulary gives to"), std::string::npos) << error_of(j);
  j = tiny_tokenizer({});
  j["model"]["type"] = "Unigram";
  EXPECT_NE(error_of(j).find("only byte-level BPE"), std::string::npos);
  j = tiny_tokenizer({});
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  EXPECT_NE(error_of(j).find("no ByteLevel step"), std::string::npos);
  j = tiny_tokenizer({});
  j["model"]["vocab"]["neg"] = -1;
  EXPECT_NE(error_of(j).find("must be a token id"), std::string::npos);
  EXPECT_NE(error_of(tiny_tokenizer({}), "bad \xff utf8").find("not valid UTF-8"), std::string::npos);
}

TEST(HfTokenizer, LoadPicksTheFileAndNamesBothWhenMissing) {
  testing::TempDir dir;
  try {
    Tokenizer::load(dir.path());
    FAIL() << "no tokenizer files";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("neither tokenizer.json"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("tiktoken.model"), std::string::npos);
  }
  std::ofstream(dir / "tokenizer.json") << tiny_tokenizer({{"a", "b"}}).dump();
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": {"content": "b", "__type": "AddedToken"}})";
  const Tokenizer tok = Tokenizer::load(dir.path());
  EXPECT_TRUE(tok.is_hf());
  EXPECT_EQ(tok.eos_id(), 'b');
  std::ofstream(dir / "tokenizer.json") << "{\"model\": ";
  EXPECT_THROW(Tokenizer::load(dir.path()), Error);
}

// ---- @huggingface/tokenizers over make-random's DeepSeek-V3-layout tokenizer.json (fixture hf_reference) ----

json reference() {
  std::ifstream in(std::filesystem::path(BG_BINARY_DIR) / "hf_reference" / "expected.json");
  if (!in.good()) return json();
  return json::parse(in);
}

TEST(HfReference, IdsMatchTokenizersJs) {
  const json e = reference();
  ASSERT_FALSE(e.is_null()) << "run the hf_reference CTest fixture first";
  for (const std::string layout : {"deepseek_v3.1", "deepseek_v3"}) {
    const Tokenizer tok = Tokenizer::load(std::filesystem::path(BG_BINARY_DIR) / "hf_reference" / layout);
    const json& cases = e["layouts"][layout]["corpus"];
    ASSERT_EQ(cases.size(), e["corpus"].size());
    for (size_t i = 0; i < cases.size(); ++i) {
      const std::string text = e["corpus"][i];
      const auto ids = tok.encode_with_special(text);
      EXPECT_EQ(ids, cases[i]["ids"].get<std::vector<int32_t>>()) << layout << " text " << i << ": " << text;
      EXPECT_EQ(tok.with_template(ids), cases[i]["ids_template"].get<std::vector<int32_t>>()) << text;
    }
  }
}

TEST(HfReference, DecodeMatchesTokenizersJs) {
  const json e = reference();
  ASSERT_FALSE(e.is_null()) << "run the hf_reference CTest fixture first";
  const Tokenizer tok = Tokenizer::load(std::filesystem::path(BG_BINARY_DIR) / "hf_reference" / "deepseek_v3.1");
  const json& cases = e["layouts"]["deepseek_v3.1"]["corpus"];
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto ids = cases[i]["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.decode(ids), cases[i]["decoded"].get<std::string>()) << i;
    EXPECT_EQ(tok.decode(ids), e["corpus"][i].get<std::string>()) << i;  // and the text round-trips
  }
}

}  // namespace
}  // namespace bg
