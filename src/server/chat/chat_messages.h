// Validated OpenAI chat requests: `messages` and `tools` checked field by field (errors name the field, for an HTTP
// 400) and normalized into plain structs the chat formats render.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace bg {

struct ChatToolCall {
  std::string id;         // may be empty (then no tool message can answer it by id)
  std::string name;       // non-empty
  std::string arguments;  // as sent: OpenAI sends a JSON string (an object is dumped compactly)
};

struct ChatMessage {
  std::string role;                // system | developer | user | assistant | tool
  std::vector<std::string> parts;  // content: one entry for a string, one per text part; empty for null
  std::string name;                // optional `name`
  std::string reasoning;           // assistant: reasoning_content (or reasoning)
  std::vector<ChatToolCall> tool_calls;  // assistant
  std::string tool_call_id;              // tool (required)
  size_t source_index = 0;               // position in the request's messages array

  std::string text() const;  // the parts joined
};

// Throws bg::Error: "messages: ...", "messages[2].role: unknown role 'foo'", "messages[1].content: ...", ...
std::vector<ChatMessage> parse_chat_messages(const nlohmann::json& messages);

// null or an array of {"type": "function", "function": {"name": ..., "description"?, "parameters"?}}. Throws
// bg::Error naming the field ("tools[0].function.name: ...").
void validate_chat_tools(const nlohmann::ordered_json& tools);

// Python's json.dumps(value, ensure_ascii=False) with its default separators ", " and ": " (what Kimi's encoder
// writes for non-string tool argument values and what the parser emits as arguments).
std::string python_json_dumps(const nlohmann::ordered_json& value);

// `text` as the body of a JSON string literal (no quotes); `text` must be valid UTF-8.
std::string json_escape(std::string_view text);

}  // namespace bg
