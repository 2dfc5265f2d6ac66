// Validation and normalization of OpenAI chat messages and tools (see chat_messages.h), plus the JSON text helpers
// the formats share.
#include "server/chat/chat_messages.h"

#include <fmt/format.h>

#include <vector>

#include "core/error.h"

namespace bg {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

const char* type_name(const json& v) { return v.type_name(); }
const char* type_name(const ordered_json& v) { return v.type_name(); }

// content: a string, an array of {"type": "text", "text": string} parts, or (where allowed) null/absent.
void parse_content(const json& m, const std::string& where, bool nullable, ChatMessage& out) {
  if (!m.contains("content") || m["content"].is_null()) {
    BG_CHECK(nullable, "{}.content: missing (a {} message needs content)", where, out.role);
    return;
  }
  const json& c = m["content"];
  if (c.is_string()) {
    out.parts.push_back(c.get<std::string>());
    return;
  }
  BG_CHECK(c.is_array(), "{}.content: must be a string or an array of text parts, not {}", where, type_name(c));
  for (size_t j = 0; j < c.size(); ++j) {
    const json& p = c[j];
    const std::string pw = fmt::format("{}.content[{}]", where, j);
    BG_CHECK(p.is_object(), "{}: must be an object, not {}", pw, type_name(p));
    BG_CHECK(p.contains("type") && p["type"].is_string(), "{}.type: missing", pw);
    const std::string type = p["type"];
    BG_CHECK(type == "text", "{}.type: unsupported content part type '{}' (only 'text')", pw, type);
    BG_CHECK(p.contains("text") && p["text"].is_string(), "{}.text: must be a string", pw);
    out.parts.push_back(p["text"].get<std::string>());
  }
}

std::string optional_string(const json& m, const char* key, const std::string& where) {
  if (!m.contains(key) || m[key].is_null()) return {};
  BG_CHECK(m[key].is_string(), "{}.{}: must be a string, not {}", where, key, type_name(m[key]));
  return m[key].get<std::string>();
}

void parse_tool_calls(const json& m, const std::string& where, ChatMessage& out) {
  if (!m.contains("tool_calls") || m["tool_calls"].is_null()) return;
  const json& calls = m["tool_calls"];
  BG_CHECK(calls.is_array(), "{}.tool_calls: must be an array, not {}", where, type_name(calls));
  for (size_t j = 0; j < calls.size(); ++j) {
    const json& tc = calls[j];
    const std::string tw = fmt::format("{}.tool_calls[{}]", where, j);
    BG_CHECK(tc.is_object(), "{}: must be an object, not {}", tw, type_name(tc));
    const std::string type = optional_string(tc, "type", tw);
    BG_CHECK(type.empty() || type == "function", "{}.type: unsupported tool call type '{}'", tw, type);
    BG_CHECK(tc.contains("function") && tc["function"].is_object(), "{}.function: missing", tw);
    const json& fn = tc["function"];
    ChatToolCall call;
    call.id = optional_string(tc, "id", tw);
    call.name = optional_string(fn, "name", tw + ".function");
    BG_CHECK(!call.name.empty(), "{}.function.name: missing", tw);
    if (fn.contains("arguments") && !fn["arguments"].is_null()) {
      const json& a = fn["arguments"];
      BG_CHECK(a.is_string() || a.is_object(), "{}.function.arguments: must be a JSON string, not {}", tw,
               type_name(a));
      call.arguments = a.is_string() ? a.get<std::string>() : a.dump();
    }
    out.tool_calls.push_back(std::move(call));
  }
}

}  // namespace

std::string ChatMessage::text() const {
  std::string s;
  for (const auto& p : parts) s += p;
  return s;
}

std::vector<ChatMessage> parse_chat_messages(const json& messages) {
  BG_CHECK(messages.is_array(), "messages: must be an array, not {}", type_name(messages));
  BG_CHECK(!messages.empty(), "messages: must not be empty");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string where = fmt::format("messages[{}]", i);
    BG_CHECK(m.is_object(), "{}: must be an object, not {}", where, type_name(m));
    BG_CHECK(m.contains("role"), "{}.role: missing", where);
    BG_CHECK(m["role"].is_string(), "{}.role: must be a string, not {}", where, type_name(m["role"]));
    ChatMessage msg;
    msg.role = m["role"];
    msg.source_index = i;
    const std::string& r = msg.role;
    BG_CHECK(r == "system" || r == "developer" || r == "user" || r == "assistant" || r == "tool",
             "{}.role: unknown role '{}'", where, r);
    parse_content(m, where, /*nullable=*/r == "assistant", msg);
    msg.name = optional_string(m, "name", where);
    if (r == "assistant") {
      msg.reasoning = optional_string(m, "reasoning_content", where);
      if (msg.reasoning.empty()) msg.reasoning = optional_string(m, "reasoning", where);
      parse_tool_calls(m, where, msg);
    }
    if (r == "tool") {
      BG_CHECK(m.contains("tool_call_id") && !m["tool_call_id"].is_null(),
               "{}.tool_call_id: missing (a tool message answers one tool call)", where);
      msg.tool_call_id = optional_string(m, "tool_call_id", where);
    }
    out.push_back(std::move(msg));
  }
  return out;
}

void validate_chat_tools(const ordered_json& tools) {
  if (tools.is_null()) return;
  BG_CHECK(tools.is_array(), "tools: must be an array, not {}", type_name(tools));
  for (size_t i = 0; i < tools.size(); ++i) {
    const ordered_json& t = tools[i];
    const std::string where = fmt::format("tools[{}]", i);
    BG_CHECK(t.is_object(), "{}: must be an object, not {}", where, type_name(t));
    BG_CHECK(t.value("type", ordered_json()) == "function", "{}.type: must be 'function'", where);
    BG_CHECK(t.contains("function") && t["function"].is_object(), "{}.function: missing", where);
    const ordered_json& fn = t["function"];
    BG_CHECK(fn.contains("name") && fn["name"].is_string() && !fn["name"].get<std::string>().empty(),
             "{}.function.name: missing", where);
    BG_CHECK(!fn.contains("description") || fn["description"].is_string() || fn["description"].is_null(),
             "{}.function.description: must be a string", where);
    BG_CHECK(!fn.contains("parameters") || fn["parameters"].is_object() || fn["parameters"].is_null(),
             "{}.function.parameters: must be a JSON Schema object", where);
  }
}

std::string json_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  for (char ch : text) {
    const auto u = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (u < 0x20) {
          out += fmt::format("\\u{:04x}", u);
        } else {
          out.push_back(ch);
        }
    }
  }
  return out;
}

namespace {

void append_python_scalar(std::string& out, const nlohmann::ordered_json& value) {
  if (value.is_string()) {
    out.push_back('"');
    out.append(json_escape(value.get_ref<const std::string&>()));
    out.push_back('"');
  } else {
    // Numbers, booleans, null: nlohmann's shortest round-trip form, as Python's repr for floats.
    out.append(value.dump());
  }
}

// Iterative (an explicit stack of open containers), so a value nested arbitrarily deep — tool-call arguments are
// client text, parsed here — cannot overflow the call stack.
void append_python_json(std::string& out, const nlohmann::ordered_json& root) {
  using It = nlohmann::ordered_json::const_iterator;
  struct Open {
    const nlohmann::ordered_json* container;
    It next;
  };
  std::vector<Open> stack;
  const nlohmann::ordered_json* value = &root;
  for (;;) {
    if (value != nullptr) {
      if (value->is_object() || value->is_array()) {
        out.push_back(value->is_object() ? '{' : '[');
        stack.push_back(Open{value, value->cbegin()});
      } else {
        append_python_scalar(out, *value);
      }
      value = nullptr;
    }
    if (stack.empty()) return;
    Open& top = stack.back();
    if (top.next == top.container->cend()) {
      out.push_back(top.container->is_object() ? '}' : ']');
      stack.pop_back();
      continue;
    }
    if (top.next != top.container->cbegin()) out.append(", ");
    if (top.container->is_object()) {
      out.push_back('"');
      out.append(json_escape(top.next.key()));
      out.append("\": ");
    }
    value = &*top.next;
    ++top.next;
  }
}

}  // namespace

std::string python_json_dumps(const nlohmann::ordered_json& value) {
  std::string out;
  append_python_json(out, value);
  return out;
}

}  // namespace bg
