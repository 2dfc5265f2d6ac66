// Parsing and validation of OpenAI request bodies (chat completions, completions) into typed requests.
// Every bad field is an ApiError(400) naming the parameter; nothing unsupported is silently ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/frontend/text_model.h"
#include "server/protocol.h"

namespace bg::frontend {

// Fields shared by both endpoints.
struct CommonRequest {
  std::string model;                       // "" when absent (the served model is used)
  std::vector<std::string> unknown_fields; // fields this server does not know (ignored; the caller logs them)
  bool stream = false;
  bool include_usage = false;              // stream_options.include_usage
  std::optional<int64_t> max_tokens;       // max_completion_tokens, else max_tokens; absent: endpoint default
  std::vector<std::string> stop;           // stop strings (non-empty each)
  proto::SamplingParams sampling;          // max_tokens is filled in later, against the context length
  bool logprobs = false;                   // report logprobs of sampled tokens
  int32_t top_logprobs = 0;                // how many alternatives per token
};

// How strictly request fields are checked.
struct ParseOptions {
  bool strict_params = false;              // an unknown field is a 400 (otherwise it is only reported)
};

struct ChatRequest {
  CommonRequest common;
  nlohmann::json messages;                 // non-empty array of objects with a string role
  nlohmann::ordered_json tools;            // array (possibly empty) of {"type": "function", "function": {...}}, in
                                           // the client's key order (parse_chat_body)
  ChatParams chat;
};

struct CompletionRequest {
  CommonRequest common;
  std::string prompt_text;                 // when the prompt is a string
  std::vector<int32_t> prompt_ids;         // when the prompt is token ids
  bool prompt_is_ids = false;
};

// Body text -> JSON object; 400 on malformed JSON, invalid UTF-8, a number out of range, nesting deeper than
// kMaxJsonDepth (json_body.h) or a non-object.
nlohmann::json parse_body(std::string_view body);

// Unknown fields are listed in common.unknown_fields, or rejected (400 naming the first, with a suggestion when it
// looks like a typo of a known one) under strict_params.
ChatRequest parse_chat_request(const nlohmann::json& body, const ParseOptions& options = {});
// Body text -> ChatRequest (parse_body's errors, then parse_chat_request's). The body is parsed once in document order
// so `tools` keeps the client's key order (a schema is rendered into the prompt as the client wrote it, as Python's
// dicts keep it for the reference templates); the other fields are validated on a sorted copy.
ChatRequest parse_chat_body(std::string_view body, const ParseOptions& options = {});
CompletionRequest parse_completion_request(const nlohmann::json& body, const ParseOptions& options = {});

// "'temprature' (did you mean 'temperature'?)" for a field of `endpoint` ("chat" or "completion").
std::string describe_unknown_field(const std::string& field, bool chat);

}  // namespace bg::frontend
