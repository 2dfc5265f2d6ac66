// Request validation: accepted shapes, and a 400 naming the parameter for each bad one.
#include <gtest/gtest.h>

#include "server/chat/chat_messages.h"
#include "server/frontend/api_error.h"
#include "server/frontend/json_body.h"
#include "server/frontend/request_parse.h"
#include "server/frontend/routes.h"

namespace bg::frontend {
namespace {

using nlohmann::json;

json chat_body(json extra = json::object()) {
  json b = {{"model", "m"}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}};
  b.update(extra);
  return b;
}

// Expects parse to fail with a 400 whose param is `param`.
template <typename F>
void expect_400(F&& parse, const std::string& param) {
  try {
    parse();
    FAIL() << "expected a 400 for " << param;
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400) << e.what();
    EXPECT_EQ(e.param(), param) << e.what();
    EXPECT_EQ(e.body()["error"]["type"], "invalid_request_error");
  }
}

TEST(RequestParse, BodyMustBeJsonObjectInUtf8) {
  EXPECT_THROW(parse_body("{not json"), ApiError);
  EXPECT_THROW(parse_body("[1, 2]"), ApiError);
  EXPECT_THROW(parse_body("{\"a\": \"\xff\xfe\"}"), ApiError);
  EXPECT_THROW(parse_body(""), ApiError);
  EXPECT_TRUE(parse_body("{\"a\": \"caf\xc3\xa9\"}").is_object());
}

TEST(RequestParse, ChatDefaultsAndFields) {
  ChatRequest r = parse_chat_request(chat_body({{"temperature", 0},
                                                {"top_p", 0.5},
                                                {"top_k", 5},
                                                {"seed", 7},
                                                {"max_completion_tokens", 9},
                                                {"max_tokens", 3},
                                                {"stop", "END"},
                                                {"stream", true},
                                                {"stream_options", {{"include_usage", true}}},
                                                {"logprobs", true},
                                                {"top_logprobs", 2},
                                                {"stop_token_ids", {1, 2}},
                                                {"chat_template_kwargs", {{"thinking", false}}}}));
  EXPECT_EQ(r.common.model, "m");
  EXPECT_EQ(r.common.sampling.temperature, 0.0f);
  EXPECT_EQ(r.common.sampling.top_p, 0.5f);
  EXPECT_EQ(r.common.sampling.top_k, 5);
  EXPECT_EQ(r.common.sampling.seed, 7u);
  EXPECT_EQ(r.common.max_tokens, 9);  // max_completion_tokens wins
  EXPECT_EQ(r.common.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(r.common.stream);
  EXPECT_TRUE(r.common.include_usage);
  EXPECT_TRUE(r.common.logprobs);
  EXPECT_EQ(r.common.top_logprobs, 2);
  EXPECT_EQ(r.common.sampling.stop_token_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r.chat.thinking, false);
  EXPECT_TRUE(r.tools.is_array());

  ChatRequest d = parse_chat_request(chat_body());
  EXPECT_FALSE(d.common.max_tokens.has_value());
  EXPECT_FALSE(d.chat.thinking.has_value()) << "unset: the chat format decides";
  EXPECT_EQ(parse_chat_request(chat_body({{"reasoning_effort", "none"}})).chat.thinking, false);
  EXPECT_EQ(parse_chat_request(chat_body({{"reasoning_effort", "high"}})).chat.reasoning_effort, "high");
}

TEST(RequestParse, ChatRejectsBadFields) {
  auto chat = [](json extra) { return [extra] { parse_chat_request(chat_body(extra)); }; };
  expect_400(chat({{"messages", json::array()}}), "messages");
  expect_400(chat({{"messages", "hello"}}), "messages");
  expect_400(chat({{"messages", {{{"content", "x"}}}}}), "messages[0].role");
  expect_400(chat({{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}), "messages[0].role");
  expect_400(chat({{"messages", {{{"role", "user"}, {"content", 5}}}}}), "messages[0].content");
  expect_400(chat({{"temperature", "hot"}}), "temperature");
  expect_400(chat({{"temperature", 3}}), "temperature");
  expect_400(chat({{"top_p", 0}}), "top_p");
  expect_400(chat({{"max_tokens", 0}}), "max_tokens");
  expect_400(chat({{"max_tokens", -5}}), "max_tokens");
  expect_400(chat({{"max_tokens", "ten"}}), "max_tokens");
  expect_400(chat({{"max_completion_tokens", 0}}), "max_completion_tokens");
  expect_400(chat({{"n", 2}}), "n");
  expect_400(chat({{"stop", 5}}), "stop");
  expect_400(chat({{"stop", {"a", 1}}}), "stop");
  expect_400(chat({{"stop", ""}}), "stop");
  expect_400(chat({{"stream", "yes"}}), "stream");
  expect_400(chat({{"stream_options", {{"include_usage", true}}}}), "stream_options");
  expect_400(chat({{"top_logprobs", 3}}), "top_logprobs");  // without logprobs
  expect_400(chat({{"logprobs", true}, {"top_logprobs", 21}}), "top_logprobs");
  expect_400(chat({{"tools", {{{"type", "function"}}}}}), "tools[0].function");
  expect_400(chat({{"tools", "x"}}), "tools");
  expect_400(chat({{"tool_choice", "required"}}), "tool_choice");
  expect_400(chat({{"presence_penalty", 0.5}}), "presence_penalty");
  expect_400(chat({{"reasoning_effort", "extreme"}}), "reasoning_effort");
  expect_400(chat({{"chat_template_kwargs", {{"thinking", "no"}}}}), "thinking");
  expect_400(chat({{"model", 5}}), "model");
  expect_400(chat({{"stop_token_ids", {-1}}}), "stop_token_ids");
  expect_400([] { parse_chat_request(json{{"model", "m"}}); }, "messages");
}

TEST(RequestParse, CompletionPrompts) {
  CompletionRequest s = parse_completion_request(json{{"prompt", "hello"}});
  EXPECT_FALSE(s.prompt_is_ids);
  EXPECT_EQ(s.prompt_text, "hello");
  CompletionRequest ids = parse_completion_request(json{{"prompt", {1, 2, 3}}, {"logprobs", 2}});
  EXPECT_TRUE(ids.prompt_is_ids);
  EXPECT_EQ(ids.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_TRUE(ids.common.logprobs);
  EXPECT_EQ(ids.common.top_logprobs, 2);
  EXPECT_EQ(parse_completion_request(json{{"prompt", {"one"}}}).prompt_text, "one");
  EXPECT_EQ(parse_completion_request(json{{"prompt", {{4, 5}}}}).prompt_ids, (std::vector<int32_t>{4, 5}));

  auto comp = [](json body) { return [body] { parse_completion_request(body); }; };
  expect_400(comp(json::object()), "prompt");
  expect_400(comp(json{{"prompt", ""}}), "prompt");
  expect_400(comp(json{{"prompt", json::array()}}), "prompt");
  expect_400(comp(json{{"prompt", {"a", "b"}}}), "prompt");
  expect_400(comp(json{{"prompt", {1, "x"}}}), "prompt");
  expect_400(comp(json{{"prompt", 5}}), "prompt");
  expect_400(comp(json{{"prompt", "x"}, {"echo", true}}), "echo");
  expect_400(comp(json{{"prompt", "x"}, {"logprobs", true}}), "logprobs");
}

TEST(RequestParse, NonStringTypesAreClientErrors) {
  auto chat = [](json extra) { return [extra] { parse_chat_request(chat_body(extra)); }; };
  expect_400(chat({{"tools", {{{"type", 5}, {"function", {{"name", "f"}}}}}}}), "tools[0]");
  expect_400(chat({{"tools", {{{"type", "function"}, {"function", {{"name", 5}}}}}}}), "tools[0].function");
  expect_400(chat({{"response_format", {{"type", {1}}}}}), "response_format");
  expect_400(chat({{"functions", json::array()}}), "functions");
  expect_400(chat({{"parallel_tool_calls", false}}), "parallel_tool_calls");
  EXPECT_NO_THROW(parse_chat_request(chat_body({{"parallel_tool_calls", true}, {"user", "u"}, {"store", false}})));
}

TEST(RequestParse, JsonDepthLimitNamesTheField) {
  const std::string ok = "{\"a\": " + std::string(kMaxJsonDepth - 1, '[') + std::string(kMaxJsonDepth - 1, ']') + "}";
  EXPECT_NO_THROW(parse_body(ok));
  const std::string deep = "{\"tools\": [{\"function\": {\"parameters\": {\"x\": " + std::string(100000, '[') +
                           std::string(100000, ']') + "}}}]}";
  try {
    parse_body(deep);
    FAIL() << "accepted 100000 levels";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_EQ(e.param().rfind("tools[0].function.parameters.x[0][0]", 0), 0u) << e.param().substr(0, 100);
    EXPECT_NE(std::string(e.what()).find("nests deeper than 128"), std::string::npos) << e.what();
  }
}

TEST(RequestParse, OrderedParseKeepsDocumentOrderAndLastDuplicate) {
  const auto o = parse_json_bounded_ordered(R"({"z": 1, "a": {"y": [1, {"q": 2, "b": 3}], "c": 4}, "z": 5})");
  EXPECT_EQ(o.dump(), R"({"z":5,"a":{"y":[1,{"q":2,"b":3}],"c":4}})");  // a repeated key: first place, last value
  EXPECT_THROW(parse_json_bounded_ordered("[[[[1]]]]", 3), ApiError);
  // Many keys in one object stay linear (the key index, not ordered_map's search): 50k keys parse at once.
  std::string many = "{";
  for (int i = 0; i < 50000; ++i) many += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":0";
  many += "}";
  EXPECT_EQ(parse_json_bounded_ordered(many).size(), 50000u);
}

TEST(RequestParse, ChatBodyKeepsToolKeyOrder) {
  const ChatRequest r = parse_chat_body(R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type":
      "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["z"], "properties":
      {"z": {"type": "string"}, "a": {"type": "string"}}}}}]})");
  EXPECT_EQ(r.tools[0]["function"]["parameters"].dump(),
            R"({"type":"object","required":["z"],"properties":{"z":{"type":"string"},"a":{"type":"string"}}})");
  EXPECT_EQ(r.tools[0].begin().key(), "type");
  // tool_choice "none" still drops the tools; errors are those of parse_chat_request.
  EXPECT_TRUE(parse_chat_body(R"({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none",
      "tools": [{"type": "function", "function": {"name": "f"}}]})").tools.empty());
  expect_400([] { parse_chat_body(R"({"messages": [], "tools": 3})"); }, "messages");
  expect_400([] { parse_chat_body("[1]"); }, "");
}

TEST(RequestParse, NumbersOutOfRangeAndParseErrorsAreCleanClientErrors) {
  try {
    parse_body(R"({"temperature": 1e400})");
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_EQ(e.param(), "temperature");
  }
  try {
    parse_body("{\"a\": tru}");
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(std::string(e.what()).find("[json.exception"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("line 1"), std::string::npos) << e.what();
  }
  // Repeated keys: the last wins (as before); big numbers that fit are kept.
  EXPECT_EQ(parse_body(R"({"a": 1, "a": 2, "b": 1e300})")["a"], 2);
}

TEST(RequestParse, UnknownFieldsAreListedOrRejected) {
  ChatRequest r = parse_chat_request(chat_body({{"temprature", 0.1}, {"frobnicate", 1}}));
  EXPECT_EQ(r.common.unknown_fields, (std::vector<std::string>{"frobnicate", "temprature"}));
  EXPECT_EQ(describe_unknown_field("temprature", true), "'temprature' (did you mean 'temperature'?)");
  EXPECT_EQ(describe_unknown_field("max_token", false), "'max_token' (did you mean 'max_tokens'?)");
  EXPECT_EQ(describe_unknown_field("frobnicate", true), "'frobnicate'");
  ParseOptions strict;
  strict.strict_params = true;
  expect_400([&] { parse_chat_request(chat_body({{"temprature", 0.1}}), strict); }, "temprature");
  expect_400([&] { parse_completion_request(json{{"prompt", "x"}, {"messages", json::array()}}, strict); },
             "messages");
  EXPECT_NO_THROW(parse_completion_request(json{{"prompt", "x"}, {"user", "u"}}, strict));
}

TEST(HttpChecks, ConstantTimeKeyCompareAndHostNames) {
  EXPECT_TRUE(constant_time_equal("sekrit", "sekrit"));
  EXPECT_FALSE(constant_time_equal("sekriT", "sekrit"));
  EXPECT_FALSE(constant_time_equal("sekrit2", "sekrit"));
  EXPECT_FALSE(constant_time_equal("", "sekrit"));
  EXPECT_FALSE(constant_time_equal("", ""));
  EXPECT_EQ(host_of("Example.COM:8000"), "example.com");
  EXPECT_EQ(host_of("[::1]:80"), "::1");
  EXPECT_EQ(host_of(" localhost "), "localhost");
}

// The chat formats' Python-style JSON writer walks values iteratively: arguments nested far deeper than any stack
// allows are written, not crashed on.
TEST(ChatJsonWriters, DeepValuesDoNotOverflowTheStack) {
  const size_t depth = 200000;
  const std::string text = std::string(depth, '[') + "1" + std::string(depth, ']');
  const auto value = nlohmann::ordered_json::parse(text);
  const std::string out = python_json_dumps(value);
  EXPECT_EQ(out, text);
  EXPECT_EQ(python_json_dumps(nlohmann::ordered_json::parse(R"({"a": [1, "x", {"b": null}], "c": {}})")),
            R"({"a": [1, "x", {"b": null}], "c": {}})");
}

}  // namespace
}  // namespace bg::frontend
