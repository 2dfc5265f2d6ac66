// Kimi K3 output parser on token streams: content only, thinking then content, tool calls (whole and one token at a
// time with the streaming deltas checked), truncation, and random garbage streams that must never throw.
#include <gtest/gtest.h>

#include <random>

#include "chat/chat_testing.h"
#include "server/tokenizer/utf8.h"

namespace bg {
namespace {

using nlohmann::json;
using testing::Parsed;
using testing::Special;

const Special kOpen{"<|open|>"}, kClose{"<|close|>"}, kSep{"<|sep|>"}, kEom{"<|end_of_msg|>"};

Parsed parse(const std::vector<testing::Piece>& pieces, bool thinking) {
  const Tokenizer& tok = testing::k3_tokenizer();
  auto parser = make_kimi_k3_chat_format(tok)->make_parser(testing::options(thinking));
  return testing::parse_all(*parser, testing::stream(tok, pieces));
}

TEST(KimiK3Parser, ContentOnly) {
  Parsed p = parse({"Hello, world! 你好", kClose, "response", kSep, kClose, "message", kSep, kEom}, false);
  EXPECT_EQ(p.content, "Hello, world! 你好");
  EXPECT_EQ(p.reasoning, "");
  EXPECT_TRUE(p.calls.empty());
}

TEST(KimiK3Parser, ThinkingThenContent) {
  Parsed p = parse({"Let me think.", kClose, "think", kSep, kOpen, "response", kSep, "The answer is 4.", kClose,
                    "response", kSep, kClose, "message", kSep, kEom},
                   true);
  EXPECT_EQ(p.reasoning, "Let me think.");
  EXPECT_EQ(p.content, "The answer is 4.");
  // An echo of the prompt's <|open|>think<|sep|> is structure, not text.
  Parsed echo = parse({kOpen, "think", kSep, "hmm", kClose, "think", kSep, kOpen, "response", kSep, "ok"}, true);
  EXPECT_EQ(echo.reasoning, "hmm");
  EXPECT_EQ(echo.content, "ok");
}

std::vector<testing::Piece> weather_call_stream() {
  return {"I should call the tool.", kClose, "think", kSep, kOpen, "response", kSep, "Checking.", kClose, "response",
          kSep, kOpen, "tools", kSep, kOpen, "call tool=\"get_weather\" index=\"1\"", kSep, kOpen,
          "argument key=\"city\" type=\"string\"", kSep, "Par\"is\n", kClose, "argument", kSep, kOpen,
          "argument key=\"days\" type=\"number\"", kSep, "3", kClose, "argument", kSep, kOpen,
          "argument key=\"opts\" type=\"object\"", kSep, "{\"unit\": \"C\"}", kClose, "argument", kSep, kClose, "call",
          kSep, kOpen, "call tool=\"now\" index=\"2\"", kSep, kClose, "call", kSep, kClose, "tools", kSep, kClose,
          "message", kSep, kEom};
}

TEST(KimiK3Parser, ToolCalls) {
  Parsed p = parse(weather_call_stream(), true);
  EXPECT_EQ(p.reasoning, "I should call the tool.");
  EXPECT_EQ(p.content, "Checking.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].id, "call_0");
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, R"({"city": "Par\"is\n", "days": 3, "opts": {"unit": "C"}})");
  EXPECT_EQ(json::parse(p.calls[0].arguments), json::parse(R"({"city": "Par\"is\n", "days": 3, "opts": {"unit": "C"}})"));
  EXPECT_EQ(p.calls[1].id, "call_1");
  EXPECT_EQ(p.calls[1].name, "now");
  EXPECT_EQ(p.calls[1].arguments, "{}");
  EXPECT_EQ(p.n_name_deltas, 2);  // id + name only on each call's first delta
}

TEST(KimiK3Parser, StreamingDeltasOneTokenAtATime) {
  const Tokenizer& tok = testing::k3_tokenizer();
  auto parser = make_kimi_k3_chat_format(tok)->make_parser(testing::options(true));
  const std::vector<int32_t> ids = testing::stream(tok, weather_call_stream());
  std::vector<ToolCallDelta> deltas;
  std::string reasoning;
  for (int32_t id : ids) {
    ChatDelta d = parser->push(id);
    reasoning += d.reasoning;
    EXPECT_TRUE(is_valid_utf8(d.content) && is_valid_utf8(d.reasoning));
    for (auto& t : d.tool_calls) deltas.push_back(t);
  }
  EXPECT_TRUE(parser->finish().empty());
  EXPECT_EQ(reasoning, "I should call the tool.");
  ASSERT_GE(deltas.size(), 4u);
  // First delta of a call: index, id, name and no arguments yet; then argument fragments without id or name.
  EXPECT_EQ(deltas[0].index, 0);
  EXPECT_EQ(deltas[0].id, "call_0");
  EXPECT_EQ(deltas[0].name, "get_weather");
  EXPECT_EQ(deltas[0].arguments, "");
  EXPECT_EQ(deltas[1].arguments, "{\"city\": \"");
  EXPECT_TRUE(deltas[1].id.empty() && deltas[1].name.empty());
  // The string value streams as the tokens arrive (more than one fragment for "Par\"is\n").
  int value_fragments = 0;
  for (size_t i = 2; i < deltas.size() && deltas[i].arguments.find("\"days\"") == std::string::npos; ++i) {
    ++value_fragments;
  }
  EXPECT_GE(value_fragments, 2);
  std::string args;
  for (const auto& d : deltas) {
    if (d.index == 0) args += d.arguments;
  }
  EXPECT_EQ(json::parse(args)["city"], "Par\"is\n");
  EXPECT_EQ(deltas.back().index, 1);
}

TEST(KimiK3Parser, TruncatedAndMalformedStructure) {
  // Truncated inside an argument: finish() closes the string and the object.
  Parsed cut = parse({kClose, "response", kSep, kOpen, "tools", kSep, kOpen, "call tool=\"f\" index=\"1\"", kSep,
                      kOpen, "argument key=\"a\" type=\"string\"", kSep, "hal"},
                     false);
  ASSERT_EQ(cut.calls.size(), 1u);
  EXPECT_EQ(cut.calls[0].arguments, R"({"a": "hal"})");
  // A typed value that is not JSON stays a string; an unknown tag is text; a stray <|sep|> is text.
  Parsed bad = parse({"x", kOpen, "bogus tag", kSep, "y", kSep, "z", kOpen, "tools", kSep, kOpen,
                      "call tool=\"f\"", kSep, kOpen, "argument key=\"n\" type=\"number\"", kSep, "12abc", kClose,
                      "argument", kSep, kClose, "call", kSep},
                     false);
  EXPECT_EQ(bad.content, "x<|open|>bogus tag<|sep|>y<|sep|>z");
  ASSERT_EQ(bad.calls.size(), 1u);
  EXPECT_EQ(bad.calls[0].arguments, R"({"n": "12abc"})");
  // A call without a tool name is not a call; a marker without <|sep|> before the next marker is text.
  Parsed noname = parse({kOpen, "tools", kSep, kOpen, "call index=\"1\"", kSep, "q", kOpen, "resp", kOpen,
                         "response", kSep, "r"},
                        false);
  EXPECT_TRUE(noname.calls.empty());
  // (inside <|open|>tools a response channel cannot open either: that tag is text too)
  EXPECT_EQ(noname.content, "<|open|>call index=\"1\"<|sep|>q<|open|>resp<|open|>response<|sep|>r");
}

TEST(KimiK3Parser, RawJsonArgumentsBlock) {
  Parsed p = parse({kOpen, "tools", kSep, kOpen, "call tool=\"f\" index=\"1\"", kSep, kOpen, "json type=\"object\"",
                    kSep, "{\"k\": [1, 2]}", kClose, "json", kSep, kClose, "call", kSep},
                   false);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].arguments, R"({"k": [1, 2]})");
}

TEST(KimiK3Parser, GarbageStreamsNeverThrow) {
  const Tokenizer& tok = testing::k3_tokenizer();
  auto fmt = make_kimi_k3_chat_format(tok);
  const std::vector<int32_t> markers = {*tok.special_id("<|open|>"), *tok.special_id("<|close|>"),
                                        *tok.special_id("<|sep|>"), *tok.special_id("<|end_of_msg|>")};
  const std::vector<std::string> words = {"think", "response", "tools", "call tool=\"f\"", "argument key=\"k\"",
                                          "argument key=\"n\" type=\"number\"", "json", "message", "\xE4\xB8", "\"",
                                          "x", "}"};
  std::mt19937 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    for (bool thinking : {true, false}) {
      auto parser = fmt->make_parser(testing::options(thinking));
      Parsed p;
      const int n = static_cast<int>(rng() % 400);
      for (int i = 0; i < n; ++i) {
        const auto r = rng() % 10;
        std::vector<int32_t> ids;
        if (r < 3) {
          ids.push_back(markers[rng() % markers.size()]);
        } else if (r < 6) {
          ids = tok.encode(words[rng() % words.size()]);
        } else {
          ids.push_back(static_cast<int32_t>(rng() % 1100));  // any id, some beyond the vocabulary
        }
        for (int32_t id : ids) {
          ChatDelta d;
          ASSERT_NO_THROW(d = parser->push(id));
          p.add(d);
        }
      }
      p.add(parser->finish());
      EXPECT_TRUE(is_valid_utf8(p.content));
      EXPECT_TRUE(is_valid_utf8(p.reasoning));
      for (const auto& c : p.calls) {
        EXPECT_FALSE(c.name.empty());
        const json args = json::parse(c.arguments, nullptr, false);
        EXPECT_TRUE(!args.is_discarded() && args.is_object()) << c.arguments;
      }
    }
  }
}

}  // namespace
}  // namespace bg
