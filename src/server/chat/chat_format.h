// Chat formats: OpenAI `messages` + `tools` -> prompt ids for a model family (Kimi K3 XTML, DeepSeek-V3.1 style),
// the stop tokens, and the incremental parser that splits generated ids into reasoning, content and tool calls.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/tokenizer/tokenizer.h"

namespace bg {

struct ChatOptions {
  bool thinking = true;
  std::string reasoning_effort;  // "" = the format's default (K3: "max"); K3 accepts low, high, max
  bool add_generation_prompt = true;
};

// OpenAI streaming: the first delta of a call has id + name, later ones argument fragments.
struct ToolCallDelta {
  int index = 0;
  std::string id;
  std::string name;
  std::string arguments;
};

struct ChatDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

// Splits generated ids into reasoning, content and tool calls, incrementally. Never throws: malformed structure
// (a random-weight model emits arbitrary ids) degrades to content text. All text it returns is valid UTF-8.
class ChatOutputParser {
 public:
  virtual ~ChatOutputParser() = default;
  virtual ChatDelta push(int32_t token) = 0;
  virtual ChatDelta finish() = 0;  // end of generation: flush what is buffered
};

class ChatFormat {
 public:
  virtual ~ChatFormat() = default;
  // config.json model_type "kimi_k3" -> the K3 XTML format; "deepseek_v3"/"kimi_k2" -> the DeepSeek-V3.1 style
  // format. Throws bg::Error for another model_type or a tokenizer without the format's special tokens.
  static std::unique_ptr<ChatFormat> for_model(const std::filesystem::path& dir, const Tokenizer& tok);
  // OpenAI `messages` (system/developer/user/assistant incl. tool_calls/tool roles; content as string or an array
  // of {type:"text"} parts) and `tools` (OpenAI function tools, may be null) -> prompt ids. Throws bg::Error with a
  // message fit for an HTTP 400 naming the bad field (e.g. "messages[2].role: unknown role 'foo'").
  virtual std::vector<int32_t> render(const nlohmann::json& messages, const nlohmann::json& tools,
                                      const ChatOptions& options) const = 0;
  virtual std::vector<int32_t> stop_token_ids() const = 0;
  // Thinking when the request does not say: on for Kimi-K3 (a reasoning model), off for DeepSeek-V3 (V3.1's template
  // default; V3 itself has no thinking mode).
  virtual bool default_thinking() const { return true; }  // K3: <|end_of_msg|> (by name from the tokenizer)
  virtual std::unique_ptr<ChatOutputParser> make_parser(const ChatOptions& options) const = 0;
};

// The formats, for callers that know the family (tests, tools). They hold a copy of `tok` (cheap: shared data).
std::unique_ptr<ChatFormat> make_kimi_k3_chat_format(const Tokenizer& tok);
std::unique_ptr<ChatFormat> make_deepseek_v3_chat_format(const Tokenizer& tok);

}  // namespace bg
