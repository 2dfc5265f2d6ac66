// Kimi K3 XTML prompt rendering, following the facts of the checkpoint's encoding_k3.py: structural markers are
// special ids, every other piece of text (tag names, each attribute's ` key`, `="`, value and `"`, each content
// part) is BPE-encoded as its own segment, so user text can never forge a marker.
#include <algorithm>

#include "core/error.h"
#include "server/chat/chat_messages.h"
#include "server/chat/kimi_k3_chat.h"

namespace bg {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;
using Attrs = std::vector<std::pair<std::string_view, std::string>>;

// `&` then `"` (that order, or the `&` of `&quot;` would be escaped again); `<` `>` stay literal.
std::string escape_attr(std::string_view v) {
  std::string out;
  for (char ch : v) {
    if (ch == '&') {
      out += "&amp;";
    } else if (ch == '"') {
      out += "&quot;";
    } else {
      out.push_back(ch);
    }
  }
  return out;
}

std::string_view xtml_type(const ordered_json& v) {
  if (v.is_boolean()) return "boolean";
  if (v.is_null()) return "null";
  if (v.is_number()) return "number";
  if (v.is_string()) return "string";
  if (v.is_object()) return "object";
  return "array";
}

bool has_non_space(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) { return c != ' ' && c != '\t' && c != '\n' && c != '\r'; });
}

class K3Writer {
 public:
  K3Writer(const Tokenizer& tok, const K3Markers& m) : tok_(tok), m_(m) {}

  void text(std::string_view s) {  // one plain segment (empty segments are dropped, as upstream)
    if (s.empty()) return;
    const std::vector<int32_t> e = tok_.encode(s);
    ids_.insert(ids_.end(), e.begin(), e.end());
  }
  void open_tag(std::string_view tag, const Attrs& attrs = {}) {
    ids_.push_back(m_.open);
    text(tag);
    for (const auto& [key, value] : attrs) {
      text(fmt::format(" {}", key));
      text("=\"");
      text(escape_attr(value));
      text("\"");
    }
    ids_.push_back(m_.sep);
  }
  void close_tag(std::string_view tag) {
    ids_.push_back(m_.close);
    text(tag);
    ids_.push_back(m_.sep);
  }
  // <|open|>message ...<|sep|> body <|close|>message<|sep|><|end_of_msg|>, body = one segment per part.
  void message(const Attrs& attrs, const std::vector<std::string>& parts) {
    open_tag("message", attrs);
    for (const auto& p : parts) text(p);
    close_tag("message");
    end_of_msg();
  }
  void end_of_msg() { ids_.push_back(m_.end_of_msg); }
  std::vector<int32_t> take() { return std::move(ids_); }

 private:
  const Tokenizer& tok_;
  const K3Markers& m_;
  std::vector<int32_t> ids_;
};

void render_tool_call(K3Writer& w, const ChatToolCall& call, size_t index, const std::string& where) {
  w.open_tag("call", {{"tool", call.name}, {"index", std::to_string(index)}});
  const bool blank = !has_non_space(call.arguments);
  ordered_json args = blank ? ordered_json::object() : ordered_json::parse(call.arguments, nullptr, false);
  if (args.is_discarded()) {
    // Arguments that are not JSON are shown back verbatim in a json block (encoding_k3's _xtml_json_block).
    w.open_tag("json", {{"type", "object"}});
    w.text(call.arguments);
    w.close_tag("json");
  } else {
    BG_CHECK(args.is_object(), "{}.function.arguments: must be a JSON object, not {}", where, args.type_name());
    for (const auto& [key, value] : args.items()) {
      w.open_tag("argument", {{"key", key}, {"type", std::string(xtml_type(value))}});
      w.text(value.is_string() ? value.get<std::string>() : python_json_dumps(value));
      w.close_tag("argument");
    }
  }
  w.close_tag("call");
}

void render_assistant(K3Writer& w, const ChatMessage& m, bool thinking) {
  Attrs attrs = {{"role", "assistant"}};
  if (!m.name.empty()) attrs.emplace_back("name", m.name);
  w.open_tag("message", attrs);
  if (thinking) {  // the think channel is structural: present (maybe empty) on every assistant turn
    w.open_tag("think");
    if (has_non_space(m.reasoning)) w.text(m.reasoning);
    w.close_tag("think");
  }
  w.open_tag("response");
  for (const auto& p : m.parts) w.text(p);
  w.close_tag("response");
  if (!m.tool_calls.empty()) {
    w.open_tag("tools");
    for (size_t j = 0; j < m.tool_calls.size(); ++j) {
      render_tool_call(w, m.tool_calls[j], j + 1, fmt::format("messages[{}].tool_calls[{}]", m.source_index, j));
    }
    w.close_tag("tools");
  }
  w.close_tag("message");
  w.end_of_msg();
}

// Consecutive tool messages, bound to the calls of the last assistant message by tool_call_id and put in call order
// (XTML binds a result to its call by position); `index` counts tool messages since that assistant message.
void render_tool_run(K3Writer& w, std::vector<const ChatMessage*> run, const ChatMessage* assistant,
                     int& tool_index) {
  std::vector<std::pair<size_t, const ChatMessage*>> bound;
  for (const ChatMessage* t : run) {
    size_t pos = assistant == nullptr ? 0 : assistant->tool_calls.size();
    for (size_t j = 0; assistant != nullptr && j < assistant->tool_calls.size(); ++j) {
      if (assistant->tool_calls[j].id == t->tool_call_id) {
        pos = j;
        break;
      }
    }
    BG_CHECK(assistant != nullptr && pos < assistant->tool_calls.size(),
             "messages[{}].tool_call_id: '{}' matches no tool call of the preceding assistant message",
             t->source_index, t->tool_call_id);
    bound.emplace_back(pos, t);
  }
  std::stable_sort(bound.begin(), bound.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [pos, t] : bound) {
    ++tool_index;
    w.message({{"role", "tool"}, {"tool", assistant->tool_calls[pos].name}, {"index", std::to_string(tool_index)}},
              t->parts);
  }
}

}  // namespace

K3Markers K3Markers::from(const Tokenizer& tok) {
  auto need = [&](std::string_view name) {
    std::optional<int32_t> id = tok.special_id(name);
    BG_CHECK(id.has_value(), "Kimi K3 chat format: the tokenizer has no special token '{}'", name);
    return *id;
  };
  return {need(kK3Open), need(kK3Close), need(kK3Sep), need(kK3EndOfMsg)};
}

std::vector<int32_t> KimiK3ChatFormat::render(const json& messages, const ordered_json& tools,
                                              const ChatOptions& options) const {
  const std::vector<ChatMessage> msgs = parse_chat_messages(messages);
  validate_chat_tools(tools);
  std::string effort = options.reasoning_effort.empty() ? "max" : options.reasoning_effort;
  if (options.thinking) {
    BG_CHECK(std::find(std::begin(kReasoningEfforts), std::end(kReasoningEfforts), effort) !=
                 std::end(kReasoningEfforts),
             "reasoning_effort: unsupported value '{}' (low, medium, high, max)", effort);
  }
  K3Writer w(tok_, markers_);
  if (tools.is_array() && !tools.empty()) {
    w.message({{"role", "system"}, {"type", "tool-declare"}},
              {fmt::format("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```",
                           tools.dump())});
  }
  if (options.thinking) {
    w.message({{"role", "system"}, {"type", "thinking-effort"}},
              {fmt::format("`thinking_effort` guides on how much to think in your thinking channel (not including "
                           "the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow "
                           "the system is invoked with `thinking_effort={}`.",
                           effort)});
  }
  const ChatMessage* assistant = nullptr;
  int tool_index = 0;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    if (m.role == "tool") {
      std::vector<const ChatMessage*> run;
      while (i < msgs.size() && msgs[i].role == "tool") run.push_back(&msgs[i++]);
      --i;
      render_tool_run(w, std::move(run), assistant, tool_index);
    } else if (m.role == "assistant") {
      assistant = &m;
      tool_index = 0;
      render_assistant(w, m, options.thinking);
    } else {
      // developer is OpenAI's newer name for system; K3 has only the system role.
      Attrs attrs = {{"role", m.role == "developer" ? "system" : m.role}};
      if (!m.name.empty()) attrs.emplace_back("name", m.name);
      w.message(attrs, m.parts);
    }
  }
  if (options.add_generation_prompt) {
    w.open_tag("message", {{"role", "assistant"}});
    w.open_tag(options.thinking ? "think" : "response");
  }
  return w.take();
}

}  // namespace bg

namespace bg {

// The K3 generation prompt opens the think element last: <|open|>think<|sep|>.
bool KimiK3ChatFormat::reasoning_open_after(std::span<const int32_t> prompt) const {
  const std::vector<int32_t> think = tok_.encode("think");
  if (prompt.size() < think.size() + 2 || prompt.back() != markers_.sep) return false;
  const size_t b = prompt.size() - 1 - think.size();
  return prompt[b - 1] == markers_.open && std::equal(think.begin(), think.end(), prompt.begin() + static_cast<std::ptrdiff_t>(b));
}

}  // namespace bg
