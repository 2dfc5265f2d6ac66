// Wire format: SSE framing, chunk and response JSON, logprobs, usage, error bodies, UTF-8 repair.
#include <gtest/gtest.h>

#include "server/frontend/api_error.h"
#include "server/frontend/openai_format.h"

namespace bg::frontend {
namespace {

using nlohmann::json;

const ResponseMeta kMeta{"chatcmpl-1", "tiny", 1700000000};

json parse_sse(const std::string& s) {
  EXPECT_EQ(s.rfind("data: ", 0), 0u) << s;
  EXPECT_EQ(s.substr(s.size() - 2), "\n\n");
  return json::parse(s.substr(6, s.size() - 8));
}

TEST(OpenAiFormat, SseFraming) {
  EXPECT_EQ(sse_done(), "data: [DONE]\n\n");
  EXPECT_EQ(sse_data(json{{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(sse_comment("keep-alive"), ": keep-alive\n\n");
  // A stray byte never breaks the stream: it becomes U+FFFD.
  EXPECT_EQ(parse_sse(sse_data(json{{"t", std::string("a\xff")}}))["t"], "a\xef\xbf\xbd");
}

TEST(OpenAiFormat, ChatChunks) {
  OutputDelta first;
  json c = chat_chunk(kMeta, first, true, false, "");
  EXPECT_EQ(c["object"], "chat.completion.chunk");
  EXPECT_EQ(c["choices"][0]["delta"], (json{{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());

  OutputDelta d;
  d.reasoning = "hmm";
  d.tool_calls = {{0, "call_0", "get", "{\"a\""}, {0, "", "", ":1}"}};
  c = chat_chunk(kMeta, d, false, false, "tool_calls");
  const json& delta = c["choices"][0]["delta"];
  EXPECT_EQ(delta["reasoning_content"], "hmm");
  EXPECT_FALSE(delta.contains("content"));
  EXPECT_EQ(delta["tool_calls"][0]["id"], "call_0");
  EXPECT_EQ(delta["tool_calls"][0]["type"], "function");
  EXPECT_EQ(delta["tool_calls"][0]["function"]["name"], "get");
  EXPECT_FALSE(delta["tool_calls"][1].contains("id"));
  EXPECT_EQ(delta["tool_calls"][1]["function"], (json{{"arguments", ":1}"}}));
  EXPECT_EQ(c["choices"][0]["finish_reason"], "tool_calls");

  json u = usage_chunk(kMeta, true, Usage{5, 3});
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"], (json{{"prompt_tokens", 5}, {"completion_tokens", 3}, {"total_tokens", 8},
                              {"prompt_tokens_details", {{"cached_tokens", 0}}}}));
  EXPECT_EQ(usage_json(Usage{5, 3, 4})["prompt_tokens_details"]["cached_tokens"], 4);
}

TEST(OpenAiFormat, ChatResponseWithToolCallsAndLogprobs) {
  FullOutput out;
  OutputDelta a;
  a.tool_calls = {{0, "call_0", "get", "{\"a\""}};
  a.logprobs = {LogprobEntry{"x", -0.25f, {{"x", -0.25f}, {"\xc3", -2.0f}}}};
  OutputDelta b;
  b.tool_calls = {{0, "", "", ":1}"}};
  out.add(a);
  out.add(b);
  json r = chat_response(kMeta, out, true, "tool_calls", Usage{4, 2});
  const json& msg = r["choices"][0]["message"];
  EXPECT_TRUE(msg["content"].is_null());
  EXPECT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["tool_calls"][0]["function"]["arguments"], "{\"a\":1}");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get");
  const json& lp = r["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(lp["token"], "x");
  EXPECT_EQ(lp["bytes"], (json{120}));
  EXPECT_EQ(lp["top_logprobs"][1]["bytes"], (json{195}));
  EXPECT_EQ(lp["top_logprobs"][1]["token"], "\xef\xbf\xbd");
  EXPECT_EQ(r["usage"]["total_tokens"], 6);
}

TEST(OpenAiFormat, CompletionLegacyLogprobs) {
  std::vector<LogprobEntry> e = {{"ab", -1.0f, {{"ab", -1.0f}, {"c", -2.0f}}}, {"d", -0.5f, {}}};
  json lp = completion_logprobs_json(e, 10);
  EXPECT_EQ(lp["tokens"], (json{"ab", "d"}));
  EXPECT_EQ(lp["token_logprobs"], (json{-1.0, -0.5}));
  EXPECT_EQ(lp["top_logprobs"][0], (json{{"ab", -1.0}, {"c", -2.0}}));
  EXPECT_EQ(lp["text_offset"], (json{10, 12}));
  OutputDelta d;
  d.text = "hi";
  json c = completion_chunk(kMeta, d, false, 0, "length");
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], "hi");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
}

TEST(OpenAiFormat, ErrorBodies) {
  json e = ApiError(400, "bad", "temperature").body();
  EXPECT_EQ(e, (json{{"error", {{"message", "bad"}, {"type", "invalid_request_error"}, {"param", "temperature"},
                                {"code", nullptr}}}}));
  EXPECT_EQ(error_body(401, "x")["error"]["type"], "authentication_error");
  EXPECT_EQ(error_body(429, "x")["error"]["type"], "rate_limit_error");
  EXPECT_EQ(error_body(500, "x")["error"]["type"], "server_error");
  EXPECT_EQ(error_body(404, "x", "model", "model_not_found")["error"]["code"], "model_not_found");
}

}  // namespace
}  // namespace bg::frontend
