// DeepSeek-V3.1 style format: golden prompts, tool calls and outputs, and the output parser (incl. garbage).
#include <gtest/gtest.h>

#include <random>

#include "chat/chat_testing.h"
#include "server/tokenizer/utf8.h"

namespace bg {
namespace {

using nlohmann::json;
using testing::Special;

std::string render_text(const json& messages, const json& tools = nullptr, ChatOptions options = {}) {
  const Tokenizer& tok = testing::ds_tokenizer();
  return tok.decode(make_deepseek_v3_chat_format(tok)->render(messages, tools, options));
}

TEST(DeepSeekV3Chat, ThinkingIsOffUnlessAsked) {
  EXPECT_FALSE(make_deepseek_v3_chat_format(testing::ds_tokenizer())->default_thinking());
}

TEST(DeepSeekV3Chat, RenderTurns) {
  json m = json::parse(R"([{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])");
  EXPECT_EQ(render_text(m), "<｜begin▁of▁sentence｜>Be nice.<｜User｜>Hi<｜Assistant｜></think>Hello"
                            "<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜><think>");
  EXPECT_EQ(render_text(m, nullptr, testing::options(false)),
            "<｜begin▁of▁sentence｜>Be nice.<｜User｜>Hi<｜Assistant｜></think>Hello<｜end▁of▁sentence｜>"
            "<｜User｜>Bye<｜Assistant｜></think>");
}

TEST(DeepSeekV3Chat, RenderToolsCallsAndOutputs) {
  json tools = json::parse(R"([{"type": "function", "function": {"name": "f", "description": "Does f.",
                                 "parameters": {"type": "object"}}}])");
  json m = json::parse(R"([{"role": "user", "content": "Go"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
    {"role": "tool", "tool_call_id": "c", "content": "done"}])");
  const std::string text = render_text(m, tools);
  EXPECT_EQ(text.rfind("<｜begin▁of▁sentence｜>## Tools\nYou have access to the following tools:\n\n### f\n"
                       "Description: Does f.\n\nParameters: {\"type\":\"object\"}\n\n",
                       0),
            0u);
  const std::string tail = "<｜User｜>Go<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>"
                           "{\"a\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
                           "<｜tool▁output▁begin｜>done<｜tool▁output▁end｜>";
  ASSERT_GE(text.size(), tail.size());
  EXPECT_EQ(text.substr(text.size() - tail.size()), tail);  // no generation prompt after tool outputs
}

TEST(DeepSeekV3Chat, ParserThinkingContentAndCalls) {
  const Tokenizer& tok = testing::ds_tokenizer();
  auto fmt = make_deepseek_v3_chat_format(tok);
  EXPECT_EQ(fmt->stop_token_ids(), std::vector<int32_t>{1});
  auto parser = fmt->make_parser(testing::options(true));
  const auto ids = testing::stream(
      tok, {"plan", Special{"</think>"}, "Calling.", Special{"<｜tool▁calls▁begin｜>"}, Special{"<｜tool▁call▁begin｜>"},
            "get_weather", Special{"<｜tool▁sep｜>"}, "{\"city\": \"Paris\"}", Special{"<｜tool▁call▁end｜>"},
            Special{"<｜tool▁call▁begin｜>"}, "noop", Special{"<｜tool▁sep｜>"}, Special{"<｜tool▁call▁end｜>"},
            Special{"<｜tool▁calls▁end｜>"}, Special{"<｜end▁of▁sentence｜>"}});
  testing::Parsed p = testing::parse_all(*parser, ids);
  EXPECT_EQ(p.reasoning, "plan");
  EXPECT_EQ(p.content, "Calling.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].id, "call_0");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\": \"Paris\"}");
  EXPECT_EQ(p.calls[1].arguments, "{}");
}

// The generation prompt ends with <think> only when thinking (after tool outputs nothing is added): the server sets
// starts_in_reasoning from this.
TEST(DeepSeekV3Chat, ReasoningOpenAfterFollowsThePrompt) {
  const Tokenizer& tok = testing::ds_tokenizer();
  auto fmt = make_deepseek_v3_chat_format(tok);
  const json hello = json::parse(R"([{"role": "user", "content": "Hi"}])");
  EXPECT_TRUE(fmt->reasoning_open_after(fmt->render(hello, nullptr, testing::options(true))));
  EXPECT_FALSE(fmt->reasoning_open_after(fmt->render(hello, nullptr, testing::options(false))));
  const json after_tool = json::parse(R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "",
      "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c", "content": "42"}])");
  EXPECT_FALSE(fmt->reasoning_open_after(fmt->render(after_tool, nullptr, testing::options(true))));
}

// Tool schemas keep the client's key order in the tool section.
TEST(DeepSeekV3Chat, ToolSchemaKeepsKeyOrder) {
  const auto tools = nlohmann::ordered_json::parse(R"([{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object", "required": ["z"], "properties": {"z": {}, "a": {}}}}}])");
  const Tokenizer& tok = testing::ds_tokenizer();
  const std::string text = tok.decode(make_deepseek_v3_chat_format(tok)->render(
      json::parse(R"([{"role": "user", "content": "Hi"}])"), tools, testing::options(false)));
  EXPECT_NE(text.find(R"({"type":"object","required":["z"],"properties":{"z":{},"a":{}}})"), std::string::npos)
      << text;
}

TEST(DeepSeekV3Chat, GarbageStreamsNeverThrow) {
  const Tokenizer& tok = testing::ds_tokenizer();
  auto fmt = make_deepseek_v3_chat_format(tok);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    auto parser = fmt->make_parser(testing::options(trial % 2 == 0));
    testing::Parsed p;
    for (int i = 0; i < 300; ++i) {
      const auto id = static_cast<int32_t>(rng() % 3 == 0 ? 480 + rng() % 40 : rng() % 520);
      ASSERT_NO_THROW(p.add(parser->push(id)));
    }
    p.add(parser->finish());
    EXPECT_TRUE(is_valid_utf8(p.content) && is_valid_utf8(p.reasoning));
    for (const auto& c : p.calls) EXPECT_TRUE(is_valid_utf8(c.arguments) && is_valid_utf8(c.name));
  }
}

}  // namespace
}  // namespace bg
