// The frontend's narrow view of the tokenizer and chat format: text <-> token ids, chat rendering and output parsing.
// load_text_model() wraps the real Tokenizer + ChatFormat; tests substitute a fake.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace bg::frontend {

struct ToolCallPiece {
  int index = 0;
  std::string id;          // set on the first piece of a call
  std::string name;        // set on the first piece of a call
  std::string arguments;   // a fragment of the JSON arguments text
};

// One step of parsed chat output.
struct ChatPiece {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallPiece> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

struct ChatParams {
  std::optional<bool> thinking;  // unset: the chat format's default (Kimi-K3 on, DeepSeek-V3 off)
  std::string reasoning_effort;  // "": the format's default; else a level the format knows (low, high, max, ...)
  // Whether the rendered prompt leaves the model inside its reasoning channel (TextModel::reasoning_open_after of the
  // prompt: a template may open the assistant turn with <think>, or not, whatever `thinking` says); unset: as
  // `thinking` says.
  std::optional<bool> starts_in_reasoning;
};

// Token ids -> text, never emitting broken UTF-8 in the middle of a stream.
class TextStream {
 public:
  virtual ~TextStream() = default;
  virtual std::string push(int32_t token) = 0;
  virtual std::string flush() = 0;
};

// Token ids -> reasoning / content / tool-call pieces.
class ChatStreamParser {
 public:
  virtual ~ChatStreamParser() = default;
  virtual ChatPiece push(int32_t token) = 0;
  virtual ChatPiece finish() = 0;
};

class TextModel {
 public:
  virtual ~TextModel() = default;
  // Plain text -> ids (special-token text is not interpreted).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // A /v1/completions text prompt -> ids as Hugging Face's `tokenizer(text)` returns them (add_special_tokens): the
  // tokenizer's template around `encode(text)`, i.e. BOS (or EOS) where the tokenizer files say so (tokenizer.json's
  // post-processor; tokenizer_config.json's add_bos_token/add_eos_token for LlamaTokenizerFast); tiktoken: none.
  virtual std::vector<int32_t> encode_prompt(std::string_view text) const = 0;
  virtual std::unique_ptr<TextStream> detokenizer() const = 0;
  // The raw bytes of one token (may be a partial UTF-8 sequence); "" for special tokens.
  virtual std::string token_bytes(int32_t token) const = 0;
  // messages/tools are the request's JSON; throws bg::Error (-> 400) on a message the format cannot render.
  virtual std::vector<int32_t> render_chat(const nlohmann::json& messages, const nlohmann::ordered_json& tools,
                                           const ChatParams& params) const = 0;
  // Whether a prompt from render_chat ends inside the reasoning channel (it ends with <think>, or K3's open think
  // element): the request's ChatParams::starts_in_reasoning, so the output parser starts in the right channel.
  virtual bool reasoning_open_after(const std::vector<int32_t>& prompt) const = 0;
  virtual std::vector<int32_t> chat_stop_ids() const = 0;
  virtual std::unique_ptr<ChatStreamParser> chat_parser(const ChatParams& params) const = 0;
  virtual int64_t vocab_size() const = 0;
};

// The model directory's tokenizer (tokenizer.json or tiktoken.model + tokenizer_config.json) and chat format
// (`chat_template`: a Jinja file replacing the checkpoint's template; "" = the checkpoint's).
std::unique_ptr<TextModel> load_text_model(const std::string& model_dir, const std::string& chat_template = "");

}  // namespace bg::frontend
