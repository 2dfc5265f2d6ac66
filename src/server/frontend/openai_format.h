// OpenAI response JSON (chat.completion, chat.completion.chunk, text_completion, usage, logprobs) and SSE framing.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "server/frontend/output_assembler.h"

namespace bg::frontend {

struct ResponseMeta {
  std::string id;        // "chatcmpl-..." / "cmpl-..."
  std::string model;
  int64_t created = 0;   // unix seconds
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens the worker reused from its prefix cache
};

nlohmann::json usage_json(const Usage& u);

// Invalid UTF-8 (a token that ends inside a character) becomes U+FFFD.
std::string sanitize_utf8(const std::string& bytes);

// chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: the legacy
// {tokens, token_logprobs, top_logprobs, text_offset} (text_offset counted from offset_base).
nlohmann::json chat_logprobs_json(const std::vector<LogprobEntry>& entries);
nlohmann::json completion_logprobs_json(const std::vector<LogprobEntry>& entries, int64_t offset_base);

// Non-streamed responses.
nlohmann::json chat_response(const ResponseMeta& meta, const FullOutput& out, bool with_logprobs,
                             const std::string& finish_reason, const Usage& usage);
nlohmann::json completion_response(const ResponseMeta& meta, const FullOutput& out, bool with_logprobs,
                                   const std::string& finish_reason, const Usage& usage);

// Streamed chunks. finish_reason "" -> null. first: the chat delta carries role "assistant".
nlohmann::json chat_chunk(const ResponseMeta& meta, const OutputDelta& d, bool first, bool with_logprobs,
                          const std::string& finish_reason);
nlohmann::json completion_chunk(const ResponseMeta& meta, const OutputDelta& d, bool with_logprobs,
                                int64_t text_offset, const std::string& finish_reason);
// The final chunk of include_usage: empty choices plus usage.
nlohmann::json usage_chunk(const ResponseMeta& meta, bool chat, const Usage& usage);

// SSE framing: "data: <json>\n\n", "data: [DONE]\n\n", and a comment line used as a keep-alive probe.
std::string sse_data(const nlohmann::json& j);
std::string sse_done();
std::string sse_comment(const std::string& text);

}  // namespace bg::frontend
