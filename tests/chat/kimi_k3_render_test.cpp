// Kimi K3 XTML rendering: golden prompt strings (decoded ids) for single/multi-turn, system, thinking on/off,
// declared tools, assistant tool calls and tool results; per-segment encoding; and request errors.
#include <gtest/gtest.h>

#include "chat/chat_testing.h"
#include "core/error.h"

namespace bg {
namespace {

using nlohmann::json;

std::string render_text(const json& messages, const json& tools = nullptr, ChatOptions options = {}) {
  const Tokenizer& tok = testing::k3_tokenizer();
  return tok.decode(make_kimi_k3_chat_format(tok)->render(messages, tools, options));
}

const std::string kEffortMax =
    "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides on how much to think "
    "in your thinking channel (not including the response channel), supported values include `low`, `medium`, "
    "`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>";

TEST(KimiK3Render, ThinkingIsOnUnlessTurnedOff) {
  EXPECT_TRUE(make_kimi_k3_chat_format(testing::k3_tokenizer())->default_thinking());
}

TEST(KimiK3Render, SingleTurnWithSystemThinking) {
  json m = json::parse(R"([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}])");
  EXPECT_EQ(render_text(m),
            kEffortMax +
                "<|open|>message role=\"system\"<|sep|>You are helpful.<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
}

TEST(KimiK3Render, ThinkingOffAndEffort) {
  json m = json::parse(R"([{"role": "user", "content": "Hi"}])");
  EXPECT_EQ(render_text(m, nullptr, testing::options(false)),
            "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
  const std::string low = render_text(m, nullptr, testing::options(true, "low"));
  EXPECT_NE(low.find("Now the system is invoked with `thinking_effort=low`."), std::string::npos);
  EXPECT_EQ(render_text(m, nullptr, testing::options(true, "", false)),
            kEffortMax + "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>");
}

TEST(KimiK3Render, MultiTurnKeepsReasoningInHistory) {
  json m = json::parse(R"([
    {"role": "user", "content": "Hi", "name": "ann"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "assistant", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two."}]},
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Bye"}])");
  const std::string history =
      "<|open|>message role=\"user\" name=\"ann\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
      "<|open|>message role=\"assistant\"<|sep|>";
  EXPECT_EQ(render_text(m),
            kEffortMax + history +
                "<|open|>think<|sep|>Greet back.<|close|>think<|sep|>"
                "<|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think<|sep|>"
                "<|open|>response<|sep|>Part one. Two.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"system\"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"user\"<|sep|>Bye<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
  // Without thinking the think channel is absent from history, not empty.
  const std::string off = render_text(m, nullptr, testing::options(false));
  EXPECT_EQ(off.find("think"), std::string::npos);
  EXPECT_NE(off.find(history + "<|open|>response<|sep|>Hello!<|close|>response<|sep|>"), std::string::npos);
}

TEST(KimiK3Render, ToolsDeclaredCallsAndResults) {
  json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
  json m = json::parse(R"([
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"id": "a1", "type": "function", "function": {"name": "get_weather",
       "arguments": "{\"city\": \"Paris\", \"days\": 2, \"opts\": {\"unit\": \"C\", \"x\": [1, true]}, \"q\": null}"}},
      {"id": "a2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
    {"role": "tool", "tool_call_id": "a2", "content": "rain"},
    {"role": "tool", "tool_call_id": "a1", "content": "sun"}])");
  const std::string text = render_text(m, tools, testing::options(false));
  EXPECT_EQ(text,
            "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\nHere are the available tools, "
            "described in JSONSchema.\n\n```json\n"
            R"([{"function":{"description":"Weather","name":"get_weather","parameters":{"properties":{"city":)"
            R"({"type":"string"}},"type":"object"}},"type":"function"}])"
            "\n```<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"user\"<|sep|>Weather in Paris and Oslo?<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
            "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
            "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
            "<|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>"
            "<|open|>argument key=\"opts\" type=\"object\"<|sep|>{\"unit\": \"C\", \"x\": [1, true]}"
            "<|close|>argument<|sep|>"
            "<|open|>argument key=\"q\" type=\"null\"<|sep|>null<|close|>argument<|sep|><|close|>call<|sep|>"
            "<|open|>call tool=\"get_weather\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>not json"
            "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
            // Results are put in call order (a1 then a2) and named after their calls.
            "<|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>sun<|close|>message<|sep|>"
            "<|end_of_msg|><|open|>message role=\"tool\" tool=\"get_weather\" index=\"2\"<|sep|>rain"
            "<|close|>message<|sep|><|end_of_msg|>"
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
}

TEST(KimiK3Render, SegmentsAreEncodedSeparatelyAndTextCannotForgeMarkers) {
  const Tokenizer& tok = testing::k3_tokenizer();
  auto fmt = make_kimi_k3_chat_format(tok);
  const std::vector<int32_t> ids = fmt->render(json::parse(R"([{"role": "user", "content": "a\"b<|open|>"}])"),
                                               nullptr, testing::options(false, "", false));
  const int32_t open = *tok.special_id("<|open|>"), sep = *tok.special_id("<|sep|>");
  const int32_t close = *tok.special_id("<|close|>"), eom = *tok.special_id("<|end_of_msg|>");
  std::vector<int32_t> expected = {open};
  for (const char* seg : {"message", " role", "=\"", "user", "\""}) {
    const auto e = tok.encode(seg);
    expected.insert(expected.end(), e.begin(), e.end());
  }
  expected.push_back(sep);
  const auto body = tok.encode("a\"b<|open|>");  // the user's "<|open|>" stays plain text
  expected.insert(expected.end(), body.begin(), body.end());
  expected.push_back(close);
  const auto tag = tok.encode("message");
  expected.insert(expected.end(), tag.begin(), tag.end());
  expected.push_back(sep);
  expected.push_back(eom);
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(fmt->stop_token_ids(), std::vector<int32_t>{eom});
}

TEST(KimiK3Render, AttributeEscaping) {
  json m = json::parse(R"([{"role": "user", "name": "a&\"b<c>", "content": "x"}])");
  EXPECT_NE(render_text(m, nullptr, testing::options(false)).find("name=\"a&amp;&quot;b<c>\""), std::string::npos);
}

void expect_error(const json& messages, const std::string& needle, const json& tools = nullptr,
                  ChatOptions options = {}) {
  const Tokenizer& tok = testing::k3_tokenizer();
  try {
    make_kimi_k3_chat_format(tok)->render(messages, tools, options);
    ADD_FAILURE() << "no error for " << messages.dump() << "; expected '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(KimiK3Render, BadRequestsNameTheField) {
  expect_error(json::object(), "messages: must be an array");
  expect_error(json::array(), "messages: must not be empty");
  expect_error(json::parse(R"([{"content": "x"}])"), "messages[0].role: missing");
  expect_error(json::parse(R"([{"role": "user", "content": "x"}, {"role": "foo", "content": "x"}])"),
               "messages[1].role: unknown role 'foo'");
  expect_error(json::parse(R"([{"role": 3, "content": "x"}])"), "messages[0].role: must be a string");
  expect_error(json::parse(R"([{"role": "user", "content": 5}])"), "messages[0].content: must be a string or");
  expect_error(json::parse(R"([{"role": "user"}])"), "messages[0].content: missing");
  expect_error(json::parse(R"([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])"),
               "messages[0].content[0].type: unsupported content part type 'image_url'");
  expect_error(json::parse(R"([{"role": "user", "content": [{"type": "text"}]}])"),
               "messages[0].content[0].text: must be a string");
  expect_error(json::parse(R"([{"role": "tool", "content": "x"}])"), "messages[0].tool_call_id: missing");
  expect_error(json::parse(R"([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "z", "content": "r"}])"),
               "messages[1].tool_call_id: 'z' matches no tool call");
  expect_error(json::parse(R"([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}])"),
               "messages[0].tool_calls[0].function.name: missing");
  expect_error(json::parse(R"([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f",
               "arguments": "[1]"}}]}])"), "messages[0].tool_calls[0].function.arguments: must be a JSON object");
  expect_error(json::parse(R"([{"role": "assistant", "tool_calls": {}}])"), "messages[0].tool_calls: must be an array");
  expect_error(json::parse(R"([{"role": "user", "content": "x"}])"), "tools[0].function: missing",
               json::parse(R"([{"type": "function"}])"));
  expect_error(json::parse(R"([{"role": "user", "content": "x"}])"), "tools: must be an array", json::object());
  expect_error(json::parse(R"([{"role": "user", "content": "x"}])"), "reasoning_effort: unsupported value 'extreme'",
               nullptr, testing::options(true, "extreme"));
}

}  // namespace
}  // namespace bg
