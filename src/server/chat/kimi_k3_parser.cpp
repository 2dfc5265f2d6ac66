// Kimi K3 output parser: a token-level state machine over the XTML markers the model generates after the generation
// prompt (<|open|>message role="assistant"<|sep|><|open|>think<|sep|> or ...response<|sep|>):
//   reasoning <|close|>think<|sep|> <|open|>response<|sep|> content <|close|>response<|sep|>
//   [<|open|>tools<|sep|> (<|open|>call tool="f" index="1"<|sep|> (<|open|>argument key="k" type="t"<|sep|> value
//    <|close|>argument<|sep|>)* <|close|>call<|sep|>)* <|close|>tools<|sep|>] <|close|>message<|sep|> <|end_of_msg|>
// A tag that is unknown, out of place, unterminated (no <|sep|> within kMaxHeaderBytes) or interrupted degrades to
// its literal text in the current channel; nothing throws.
#include <fmt/format.h>

#include <map>

#include "server/chat/chat_messages.h"
#include "server/chat/delta_sink.h"
#include "server/chat/kimi_k3_chat.h"

namespace bg {
namespace {

constexpr size_t kMaxHeaderBytes = 512;
constexpr int32_t kNoMarker = -1;

enum class Region { kThink, kResponse, kOutside, kTools, kCall, kArgument, kJson, kDone };

// `tag key="value" ...` of an open marker; attribute values unescaped (&quot; before &amp;, the inverse order).
struct Header {
  std::string tag;
  std::map<std::string, std::string> attrs;
  bool ok = true;
};

std::string unescape_attr(std::string v) {
  for (auto [from, to] : {std::pair<std::string_view, std::string_view>{"&quot;", "\""}, {"&amp;", "&"}}) {
    for (size_t p = v.find(from); p != std::string::npos; p = v.find(from, p + to.size())) v.replace(p, from.size(), to);
  }
  return v;
}

Header parse_header(std::string_view h) {
  Header out;
  size_t i = h.find(' ');
  out.tag = std::string(h.substr(0, i));
  while (i != std::string_view::npos && i < h.size()) {
    while (i < h.size() && h[i] == ' ') ++i;
    if (i >= h.size()) break;
    const size_t eq = h.find("=\"", i);
    const size_t end = eq == std::string_view::npos ? eq : h.find('"', eq + 2);
    if (end == std::string_view::npos) {
      out.ok = false;
      break;
    }
    out.attrs[std::string(h.substr(i, eq - i))] = unescape_attr(std::string(h.substr(eq + 2, end - eq - 2)));
    i = end + 1;
  }
  return out;
}

class KimiK3Parser : public ChatOutputParser {
 public:
  KimiK3Parser(const Tokenizer& tok, const K3Markers& m, bool thinking)
      : tok_(tok), m_(m), region_(thinking ? Region::kThink : Region::kResponse) {}

  ChatDelta push(int32_t token) override {
    if (token == m_.open || token == m_.close) {
      sink_.flush_text();
      if (marker_ != kNoMarker) degrade();
      marker_ = token;
      header_.clear();
    } else if (token == m_.sep) {
      sink_.flush_text();
      if (marker_ == kNoMarker) {
        text(kK3Sep);
      } else {
        on_tag();
      }
    } else if (token == m_.end_of_msg) {
      finish_structure();
      region_ = Region::kDone;
    } else if (!tok_.is_known(token)) {
      text(kReplacementChar);
    } else if (!tok_.is_special(token)) {
      if (marker_ != kNoMarker) {
        header_ += tok_.token_bytes(token);
        if (header_.size() > kMaxHeaderBytes) degrade();
      } else {
        text(tok_.token_bytes(token));
      }
    }  // other special tokens carry no text: skipped
    return sink_.take();
  }

  ChatDelta finish() override {
    finish_structure();
    sink_.flush_text();
    return sink_.take();
  }

 private:
  // Text routed by region: reasoning in the think channel, argument values into the open argument, everything
  // else (the response channel, and stray text between structures) is content.
  void text(std::string_view bytes) {
    switch (region_) {
      case Region::kThink: sink_.reasoning(bytes); return;
      case Region::kArgument:
        if (arg_is_string_) {
          sink_.tool_arguments(call_index_, json_escape(arg_utf8_.push(bytes)));
        } else {
          arg_raw_ += bytes;
        }
        return;
      case Region::kJson: arg_raw_ += bytes; return;
      default: sink_.content(bytes); return;
    }
  }

  // The marker and header read so far were not a tag: they become text.
  void degrade() {
    std::string literal(marker_ == m_.open ? kK3Open : kK3Close);
    literal += header_;
    marker_ = kNoMarker;
    header_.clear();
    text(literal);
  }

  void on_tag() {
    const int32_t marker = marker_;
    std::string header = std::move(header_);
    marker_ = kNoMarker;
    header_.clear();
    const Header h = parse_header(header);
    const bool handled = h.ok && (marker == m_.open ? on_open(h) : on_close(h.tag));
    if (!handled) {
      marker_ = marker;
      header_ = std::move(header);
      degrade();
      text(kK3Sep);
    }
  }

  bool on_open(const Header& h) {
    const Region r = region_;
    if (h.tag == "think") {
      if (r != Region::kThink && r != Region::kOutside) return false;
      region_ = Region::kThink;  // also the echo of the prompt's opener
    } else if (h.tag == "response") {
      if (r != Region::kThink && r != Region::kOutside && r != Region::kResponse) return false;
      region_ = Region::kResponse;
    } else if (h.tag == "tools") {
      if (r != Region::kThink && r != Region::kOutside && r != Region::kResponse) return false;
      region_ = Region::kTools;
    } else if (h.tag == "call") {
      auto tool = h.attrs.find("tool");
      if (r != Region::kTools || tool == h.attrs.end() || tool->second.empty()) return false;
      call_index_ = n_calls_++;
      args_started_ = args_closed_ = false;
      sink_.tool_start(call_index_, fmt::format("call_{}", call_index_), sanitize_utf8(tool->second));
      region_ = Region::kCall;
    } else if (h.tag == "argument") {
      auto key = h.attrs.find("key");
      if (r != Region::kCall || args_closed_ || key == h.attrs.end()) return false;
      auto type = h.attrs.find("type");
      arg_is_string_ = type == h.attrs.end() || type->second == "string";
      std::string fragment = args_started_ ? ", " : "{";
      fragment += fmt::format("\"{}\": ", json_escape(sanitize_utf8(key->second)));
      if (arg_is_string_) fragment += "\"";
      sink_.tool_arguments(call_index_, fragment);
      args_started_ = true;
      arg_raw_.clear();
      region_ = Region::kArgument;
    } else if (h.tag == "json") {
      if (r != Region::kCall || args_started_) return false;
      arg_raw_.clear();
      region_ = Region::kJson;
    } else {
      return h.tag == "message" && r == Region::kDone;  // a new message after the end: ignored
    }
    return true;
  }

  bool on_close(const std::string& tag) {
    const Region r = region_;
    if (tag == "think" && r == Region::kThink) {
      region_ = Region::kOutside;
    } else if (tag == "response" && r == Region::kResponse) {
      region_ = Region::kOutside;
    } else if (tag == "argument" && r == Region::kArgument) {
      end_argument();
    } else if (tag == "json" && r == Region::kJson) {
      end_json();
    } else if (tag == "call" && (r == Region::kCall || r == Region::kArgument || r == Region::kJson)) {
      end_call();
    } else if (tag == "tools" && (r == Region::kTools || r == Region::kCall || r == Region::kArgument)) {
      finish_structure();
      region_ = Region::kOutside;
    } else if (tag == "message") {
      finish_structure();
      region_ = Region::kDone;
    } else {
      return false;
    }
    return true;
  }

  void end_argument() {
    if (arg_is_string_) {
      sink_.tool_arguments(call_index_, json_escape(arg_utf8_.flush()) + "\"");
    } else {
      // A typed value is JSON; when it is not (truncated, random), it is kept as a string so the object stays JSON.
      const auto v = nlohmann::ordered_json::parse(arg_raw_, nullptr, false);
      sink_.tool_arguments(call_index_, v.is_discarded() ? fmt::format("\"{}\"", json_escape(sanitize_utf8(arg_raw_)))
                                                          : python_json_dumps(v));
    }
    region_ = Region::kCall;
  }

  void end_json() {  // raw JSON arguments: used when they are an object, dropped otherwise
    const auto v = nlohmann::ordered_json::parse(arg_raw_, nullptr, false);
    if (!v.is_discarded() && v.is_object()) {
      sink_.tool_arguments(call_index_, python_json_dumps(v));
      args_started_ = args_closed_ = true;
    }
    region_ = Region::kCall;
  }

  void end_call() {
    if (region_ == Region::kArgument) end_argument();
    if (region_ == Region::kJson) end_json();
    if (!args_started_) sink_.tool_arguments(call_index_, "{}");
    if (args_started_ && !args_closed_) sink_.tool_arguments(call_index_, "}");
    region_ = Region::kTools;
  }

  // Closes whatever tool call is open, so every streamed call's arguments end as a JSON object.
  void finish_structure() {
    if (marker_ != kNoMarker) degrade();
    if (region_ == Region::kCall || region_ == Region::kArgument || region_ == Region::kJson) end_call();
  }

  Tokenizer tok_;  // a copy shares the immutable vocabulary: no lifetime coupling to the caller's object
  K3Markers m_;
  Region region_;
  DeltaSink sink_;
  int32_t marker_ = kNoMarker;  // the pending open/close marker id while its header is read
  std::string header_;
  int n_calls_ = 0, call_index_ = 0;
  bool args_started_ = false, args_closed_ = false, arg_is_string_ = true;
  Utf8Assembler arg_utf8_;
  std::string arg_raw_;
};

}  // namespace

std::unique_ptr<ChatOutputParser> KimiK3ChatFormat::make_parser(const ChatOptions& options) const {
  return std::make_unique<KimiK3Parser>(tok_, markers_, options.starts_in_reasoning.value_or(options.thinking));
}

}  // namespace bg
