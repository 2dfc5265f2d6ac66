// Building ChatDelta values out of raw token bytes: per-channel UTF-8 assembly (never a broken sequence in a delta)
// and tool call deltas merged per call within one push.
#pragma once

#include <string>
#include <string_view>

#include "server/chat/chat_format.h"
#include "server/tokenizer/utf8.h"

namespace bg {

class DeltaSink {
 public:
  void reasoning(std::string_view bytes) { delta_.reasoning += reasoning_.push(bytes); }
  void content(std::string_view bytes) { delta_.content += content_.push(bytes); }
  // Ends the text channels at a structural boundary: an unfinished code point becomes U+FFFD.
  void flush_text() {
    delta_.reasoning += reasoning_.flush();
    delta_.content += content_.flush();
  }
  void tool_start(int index, std::string id, std::string name) {
    delta_.tool_calls.push_back({index, std::move(id), std::move(name), ""});
  }
  void tool_arguments(int index, std::string_view fragment) {
    if (fragment.empty()) return;
    if (delta_.tool_calls.empty() || delta_.tool_calls.back().index != index) {
      delta_.tool_calls.push_back({index, "", "", ""});
    }
    delta_.tool_calls.back().arguments += fragment;
  }
  ChatDelta take() {
    ChatDelta out = std::move(delta_);
    delta_ = ChatDelta{};
    return out;
  }

 private:
  Utf8Assembler reasoning_, content_;
  ChatDelta delta_;
};

}  // namespace bg
