// Builders for the OpenAI wire format; every string goes through dump_json's UTF-8 replacement.
#include "server/frontend/openai_format.h"

#include "server/frontend/api_error.h"

namespace bg::frontend {

using nlohmann::json;

namespace {

json byte_list(const std::string& bytes) {
  json out = json::array();
  for (char c : bytes) out.push_back(static_cast<int>(static_cast<unsigned char>(c)));
  return out;
}

json tool_calls_json(const std::vector<ToolCallPiece>& calls, bool streamed) {
  json out = json::array();
  for (const ToolCallPiece& c : calls) {
    json call = {{"index", c.index}};
    json fn = json::object();
    if (!c.id.empty() || !streamed) {
      call["id"] = c.id;
      call["type"] = "function";
    }
    if (!c.name.empty() || !streamed) fn["name"] = c.name;
    fn["arguments"] = c.arguments;
    call["function"] = std::move(fn);
    out.push_back(std::move(call));
  }
  return out;
}

json finish_json(const std::string& finish_reason) {
  return finish_reason.empty() ? json(nullptr) : json(finish_reason);
}

}  // namespace

std::string sanitize_utf8(const std::string& bytes) {
  // json's replace handler performs exactly the U+FFFD substitution; strip the quotes it adds.
  std::string quoted = json(bytes).dump(-1, ' ', false, json::error_handler_t::replace);
  return json::parse(quoted).get<std::string>();
}

json usage_json(const Usage& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

json chat_logprobs_json(const std::vector<LogprobEntry>& entries) {
  json content = json::array();
  for (const LogprobEntry& e : entries) {
    json top = json::array();
    for (const auto& [bytes, logprob] : e.top) {
      top.push_back({{"token", sanitize_utf8(bytes)}, {"logprob", logprob}, {"bytes", byte_list(bytes)}});
    }
    content.push_back({{"token", sanitize_utf8(e.bytes)},
                       {"logprob", e.logprob},
                       {"bytes", byte_list(e.bytes)},
                       {"top_logprobs", std::move(top)}});
  }
  return json{{"content", std::move(content)}};
}

json completion_logprobs_json(const std::vector<LogprobEntry>& entries, int64_t offset_base) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  int64_t offset = offset_base;
  for (const LogprobEntry& e : entries) {
    const std::string text = sanitize_utf8(e.bytes);
    tokens.push_back(text);
    token_logprobs.push_back(e.logprob);
    json alts = json::object();
    for (const auto& [bytes, logprob] : e.top) alts[sanitize_utf8(bytes)] = logprob;
    top.push_back(std::move(alts));
    offsets.push_back(offset);
    offset += static_cast<int64_t>(e.bytes.size());
  }
  return json{{"tokens", std::move(tokens)},
              {"token_logprobs", std::move(token_logprobs)},
              {"top_logprobs", std::move(top)},
              {"text_offset", std::move(offsets)}};
}

json chat_response(const ResponseMeta& meta, const FullOutput& out, bool with_logprobs,
                   const std::string& finish_reason, const Usage& usage) {
  json message = {{"role", "assistant"}, {"content", out.text.empty() && !out.tool_calls.empty() ? json(nullptr)
                                                                                                  : json(out.text)}};
  if (!out.reasoning.empty()) message["reasoning_content"] = out.reasoning;
  if (!out.tool_calls.empty()) message["tool_calls"] = tool_calls_json(out.tool_calls, false);
  json choice = {{"index", 0},
                 {"message", std::move(message)},
                 {"logprobs", with_logprobs ? chat_logprobs_json(out.logprobs) : json(nullptr)},
                 {"finish_reason", finish_json(finish_reason)}};
  return json{{"id", meta.id},           {"object", "chat.completion"}, {"created", meta.created},
              {"model", meta.model},     {"choices", json::array({std::move(choice)})},
              {"usage", usage_json(usage)}};
}

json completion_response(const ResponseMeta& meta, const FullOutput& out, bool with_logprobs,
                         const std::string& finish_reason, const Usage& usage) {
  json choice = {{"index", 0},
                 {"text", out.text},
                 {"logprobs", with_logprobs ? completion_logprobs_json(out.logprobs, 0) : json(nullptr)},
                 {"finish_reason", finish_json(finish_reason)}};
  return json{{"id", meta.id},       {"object", "text_completion"}, {"created", meta.created},
              {"model", meta.model}, {"choices", json::array({std::move(choice)})},
              {"usage", usage_json(usage)}};
}

json chat_chunk(const ResponseMeta& meta, const OutputDelta& d, bool first, bool with_logprobs,
                const std::string& finish_reason) {
  json delta = json::object();
  if (first) delta["role"] = "assistant";
  if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
  if (!d.text.empty() || (first && d.reasoning.empty() && d.tool_calls.empty())) delta["content"] = d.text;
  if (!d.tool_calls.empty()) delta["tool_calls"] = tool_calls_json(d.tool_calls, true);
  json choice = {{"index", 0},
                 {"delta", std::move(delta)},
                 {"logprobs", with_logprobs && !d.logprobs.empty() ? chat_logprobs_json(d.logprobs) : json(nullptr)},
                 {"finish_reason", finish_json(finish_reason)}};
  return json{{"id", meta.id},
              {"object", "chat.completion.chunk"},
              {"created", meta.created},
              {"model", meta.model},
              {"choices", json::array({std::move(choice)})}};
}

json completion_chunk(const ResponseMeta& meta, const OutputDelta& d, bool with_logprobs, int64_t text_offset,
                      const std::string& finish_reason) {
  json choice = {{"index", 0},
                 {"text", d.text},
                 {"logprobs", with_logprobs && !d.logprobs.empty() ? completion_logprobs_json(d.logprobs, text_offset)
                                                                   : json(nullptr)},
                 {"finish_reason", finish_json(finish_reason)}};
  return json{{"id", meta.id},
              {"object", "text_completion"},
              {"created", meta.created},
              {"model", meta.model},
              {"choices", json::array({std::move(choice)})}};
}

json usage_chunk(const ResponseMeta& meta, bool chat, const Usage& usage) {
  return json{{"id", meta.id},
              {"object", chat ? "chat.completion.chunk" : "text_completion"},
              {"created", meta.created},
              {"model", meta.model},
              {"choices", json::array()},
              {"usage", usage_json(usage)}};
}

std::string sse_data(const json& j) { return "data: " + dump_json(j) + "\n\n"; }
std::string sse_done() { return "data: [DONE]\n\n"; }
std::string sse_comment(const std::string& text) { return ": " + text + "\n\n"; }

}  // namespace bg::frontend
