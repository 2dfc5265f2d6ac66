// Chat formats: OpenAI `messages` + `tools` -> prompt ids for a model family (the checkpoint's own Jinja chat_template,
// the hand-written Kimi K3 XTML, a built-in DeepSeek-V3.1 style when a checkpoint ships no template), the stop tokens,
// and the incremental parser that splits generated ids into reasoning, content and tool calls.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "server/tokenizer/tokenizer.h"

namespace bg {

// The reasoning_effort values every format accepts (the request parser's set, besides "none" = thinking off):
// Kimi K3 writes the level into its thinking-effort note; templates receive it as `reasoning_effort`; the built-in
// DeepSeek format has no levels (thinking on or off only).
inline constexpr std::string_view kReasoningEfforts[] = {"low", "medium", "high", "max"};

struct ChatOptions {
  bool thinking = true;
  std::string reasoning_effort;  // "" = the format's default (K3: "max"); else one of kReasoningEfforts
  bool add_generation_prompt = true;
  // Whether generation starts inside the reasoning channel (ChatFormat::reasoning_open_after(prompt)); unset: as
  // `thinking` says.
  std::optional<bool> starts_in_reasoning;
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
  // The checkpoint's format: `template_file` (a Jinja file) when given; else for model_type "deepseek_v3"/"kimi_k2"
  // the checkpoint's chat_template (tokenizer_config.json, else chat_template.jinja), or the built-in DeepSeek-V3.1
  // style when it ships none (logged); for "kimi_k3" the hand-written K3 XTML format. Throws bg::Error for another
  // model_type, a template that does not parse, or a tokenizer without the format's special tokens.
  static std::unique_ptr<ChatFormat> for_model(const std::filesystem::path& dir, const Tokenizer& tok,
                                               const std::filesystem::path& template_file = {});
  // OpenAI `messages` (system/developer/user/assistant incl. tool_calls/tool roles; content as string or an array
  // of {type:"text"} parts) and `tools` (OpenAI function tools, may be null) -> prompt ids. Throws bg::Error with a
  // message fit for an HTTP 400 naming the bad field (e.g. "messages[2].role: unknown role 'foo'").
  virtual std::vector<int32_t> render(const nlohmann::json& messages, const nlohmann::ordered_json& tools,
                                      const ChatOptions& options) const = 0;
  // The prompt as text: a template's rendered output (before tokenization), else the decoded ids.
  virtual std::string render_text(const nlohmann::json& messages, const nlohmann::ordered_json& tools,
                                  const ChatOptions& options) const = 0;
  virtual std::vector<int32_t> stop_token_ids() const = 0;
  // Thinking when the request does not say: on for Kimi-K3 (a reasoning model), off for DeepSeek-V3 (V3.1's template
  // default; V3 itself has no thinking mode).
  virtual bool default_thinking() const { return true; }  // K3: <|end_of_msg|> (by name from the tokenizer)
  virtual std::unique_ptr<ChatOutputParser> make_parser(const ChatOptions& options) const = 0;
  // Whether a rendered prompt leaves the model inside its reasoning channel (it ends with <think>, or K3's open
  // think element): set ChatOptions::starts_in_reasoning from it before make_parser.
  virtual bool reasoning_open_after(std::span<const int32_t> prompt) const;
  // "kimi_k3 (built-in XTML)", "chat_template from tokenizer_config.json", ... (logged at load).
  virtual std::string describe() const = 0;
};

// The formats, for callers that know the family (tests, tools). They hold a copy of `tok` (cheap: shared data).
std::unique_ptr<ChatFormat> make_kimi_k3_chat_format(const Tokenizer& tok);
std::unique_ptr<ChatFormat> make_deepseek_v3_chat_format(const Tokenizer& tok);
// A Jinja chat template (`source`, named `name` in errors) over `tok`; `model_dir` supplies generation_config.json's
// extra stop ids (may be empty).
std::unique_ptr<ChatFormat> make_template_chat_format(const Tokenizer& tok, const std::string& source,
                                                      const std::string& name,
                                                      const std::filesystem::path& model_dir = {});
// The output parser for a vocabulary's markers, for the template format: Kimi-K2 tool-call markers, DeepSeek tool-call
// markers, Kimi-K3 XTML, or plain text with <think>...</think> when the tokenizer has them.
std::unique_ptr<ChatOutputParser> make_deepseek_v3_parser(const Tokenizer& tok, bool starts_in_reasoning);
std::unique_ptr<ChatOutputParser> make_kimi_k2_parser(const Tokenizer& tok, bool starts_in_reasoning);

}  // namespace bg
