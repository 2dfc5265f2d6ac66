// Building ChatDelta values out of raw token bytes: per-channel UTF-8 assembly (never a broken sequence in a delta)
// and tool call deltas merged per call within one push; MarkerParser, the token loop of the tool-call parsers.
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

// The token loop shared by the parsers whose structure is carried by control tokens (Kimi-K2, DeepSeek): an id the
// vocabulary does not know is U+FFFD text, an ordinary token is text, a control token flushes the text channels and
// is a marker. Subclasses route text by their region and close an open tool call at the end.
class MarkerParser : public ChatOutputParser {
 public:
  ChatDelta push(int32_t token) final {
    if (!tok_.is_known(token)) {
      text(kReplacementChar);
    } else if (!tok_.is_control(token)) {
      text(tok_.token_bytes(token));
    } else {
      sink_.flush_text();
      on_marker(token);
    }
    return sink_.take();
  }

  ChatDelta finish() final {
    end_call();
    sink_.flush_text();
    return sink_.take();
  }

 protected:
  explicit MarkerParser(const Tokenizer& tok) : tok_(tok) {}

  virtual void text(std::string_view bytes) = 0;
  virtual void on_marker(int32_t token) = 0;
  virtual void end_call() = 0;  // end of generation inside a tool call: close it

  Tokenizer tok_;  // a copy shares the immutable vocabulary: no lifetime coupling to the caller's object
  DeltaSink sink_;
};

}  // namespace bg
