// Kimi K3 "XTML" chat format (internal header): the structural marker ids and the format / parser classes, split
// over kimi_k3_render.cpp (prompt) and kimi_k3_parser.cpp (output). See docs/TOKENIZER_AND_CHAT.md.
#pragma once

#include <memory>

#include "server/chat/chat_format.h"

namespace bg {

// Special-token ids of the four structural markers, looked up by name.
struct K3Markers {
  int32_t open = -1, close = -1, sep = -1, end_of_msg = -1;
  static K3Markers from(const Tokenizer& tok);  // throws bg::Error naming a missing marker
};

inline constexpr std::string_view kK3Open = "<|open|>";
inline constexpr std::string_view kK3Close = "<|close|>";
inline constexpr std::string_view kK3Sep = "<|sep|>";
inline constexpr std::string_view kK3EndOfMsg = "<|end_of_msg|>";

class KimiK3ChatFormat : public ChatFormat {
 public:
  explicit KimiK3ChatFormat(const Tokenizer& tok) : tok_(tok), markers_(K3Markers::from(tok)) {}
  std::vector<int32_t> render(const nlohmann::json& messages, const nlohmann::ordered_json& tools,
                              const ChatOptions& options) const override;
  std::string render_text(const nlohmann::json& messages, const nlohmann::ordered_json& tools,
                          const ChatOptions& options) const override {
    return tok_.decode(render(messages, tools, options));
  }
  std::vector<int32_t> stop_token_ids() const override { return {markers_.end_of_msg}; }
  std::unique_ptr<ChatOutputParser> make_parser(const ChatOptions& options) const override;
  bool reasoning_open_after(std::span<const int32_t> prompt) const override;
  std::string describe() const override { return "built-in Kimi-K3 XTML"; }

 private:
  Tokenizer tok_;  // a copy shares the immutable vocabulary: no lifetime coupling to the caller's object
  K3Markers markers_;
};

}  // namespace bg
