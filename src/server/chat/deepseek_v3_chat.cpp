// DeepSeek-V3.1 style chat format (used for model_type deepseek_v3 and kimi_k2): the rendering of DeepSeek-V3.1's
// chat template (<｜User｜>/<｜Assistant｜> turns, <think>/</think>, tool calls as name<｜tool▁sep｜>JSON arguments,
// tool outputs) with the markers as special ids and all message text encoded as plain text, and its output parser.
#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "server/chat/chat_format.h"
#include "server/chat/chat_messages.h"
#include "server/chat/delta_sink.h"

namespace bg {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

struct DsMarkers {
  int32_t bos, eos, user, assistant, think, end_think;
  int32_t calls_begin, calls_end, call_begin, call_end, tool_sep, output_begin, output_end;

  // What the output parser needs: the tool-call markers and end of sentence; <think>/</think> when the vocabulary
  // has them (-1 otherwise: DeepSeek-V3 without R1's markers).
  static DsMarkers for_parser(const Tokenizer& tok) {
    auto need = [&](std::string_view name) {
      std::optional<int32_t> id = tok.special_id(name);
      BG_CHECK(id.has_value(), "DeepSeek chat output: the tokenizer has no token '{}'", name);
      return *id;
    };
    auto optional = [&](std::string_view name) { return tok.special_id(name).value_or(-1); };
    return {optional("<｜begin▁of▁sentence｜>"), need("<｜end▁of▁sentence｜>"), optional("<｜User｜>"),
            optional("<｜Assistant｜>"), optional("<think>"), optional("</think>"), need("<｜tool▁calls▁begin｜>"),
            need("<｜tool▁calls▁end｜>"), need("<｜tool▁call▁begin｜>"), need("<｜tool▁call▁end｜>"),
            need("<｜tool▁sep｜>"), optional("<｜tool▁output▁begin｜>"), optional("<｜tool▁output▁end｜>")};
  }

  static DsMarkers from(const Tokenizer& tok) {
    auto need = [&](std::string_view name) {
      std::optional<int32_t> id = tok.special_id(name);
      BG_CHECK(id.has_value(), "DeepSeek-V3 chat format: the tokenizer has no special token '{}'", name);
      return *id;
    };
    return {need("<｜begin▁of▁sentence｜>"), need("<｜end▁of▁sentence｜>"), need("<｜User｜>"),
            need("<｜Assistant｜>"), need("<think>"), need("</think>"), need("<｜tool▁calls▁begin｜>"),
            need("<｜tool▁calls▁end｜>"), need("<｜tool▁call▁begin｜>"), need("<｜tool▁call▁end｜>"),
            need("<｜tool▁sep｜>"), need("<｜tool▁output▁begin｜>"), need("<｜tool▁output▁end｜>")};
  }
};

// Prompt builder: markers are ids; text between two markers is one run, encoded as plain text in one piece (as a
// template string between special tokens would be).
class DsWriter {
 public:
  explicit DsWriter(const Tokenizer& tok) : tok_(tok) {}
  void control(int32_t id) {
    flush();
    ids_.push_back(id);
  }
  void text(std::string_view s) { run_ += s; }
  std::vector<int32_t> take() {
    flush();
    return std::move(ids_);
  }

 private:
  void flush() {
    if (run_.empty()) return;
    const std::vector<int32_t> e = tok_.encode(run_);
    ids_.insert(ids_.end(), e.begin(), e.end());
    run_.clear();
  }
  Tokenizer tok_;  // a copy shares the immutable vocabulary: no lifetime coupling to the caller's object
  std::string run_;
  std::vector<int32_t> ids_;
};

// The tool section of the system prompt (DeepSeek-V3.1 model card; its template itself does not render `tools`).
void write_tools_section(DsWriter& w, const ordered_json& tools, const DsMarkers& m) {
  w.text("## Tools\nYou have access to the following tools:\n\n");
  for (const auto& t : tools) {
    const ordered_json& fn = t["function"];
    const ordered_json description = fn.value("description", ordered_json(""));
    w.text(fmt::format("### {}\nDescription: {}\n\nParameters: {}\n\n", fn["name"].get<std::string>(),
                       description.is_string() ? description.get<std::string>() : std::string(),
                       fn.value("parameters", ordered_json::object()).dump()));
  }
  w.text("IMPORTANT: ALWAYS adhere to this exact format for tool use:\n");
  w.control(m.calls_begin);
  w.control(m.call_begin);
  w.text("tool_call_name");
  w.control(m.tool_sep);
  w.text("tool_call_arguments");
  w.control(m.call_end);
  w.text("{{additional_tool_calls}}");
  w.control(m.calls_end);
  w.text("\n\nWhere:\n\n- `tool_call_name` must be an exact match to one of the available tools\n"
         "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
         "- For multiple tool calls, chain them directly without separators or spaces\n");
}

class DeepSeekV3ChatFormat : public ChatFormat {
 public:
  bool default_thinking() const override { return false; }
  explicit DeepSeekV3ChatFormat(const Tokenizer& tok) : tok_(tok), m_(DsMarkers::from(tok)) {}

  std::vector<int32_t> render(const json& messages, const ordered_json& tools,
                              const ChatOptions& options) const override {
    const std::vector<ChatMessage> msgs = parse_chat_messages(messages);
    validate_chat_tools(tools);
    BG_CHECK(options.reasoning_effort.empty() ||
                 std::find(std::begin(kReasoningEfforts), std::end(kReasoningEfforts), options.reasoning_effort) !=
                     std::end(kReasoningEfforts),
             "reasoning_effort: unsupported value '{}' (low, medium, high, max)", options.reasoning_effort);
    DsWriter w(tok_);
    w.control(m_.bos);
    std::string system;
    for (const auto& msg : msgs) {
      if (msg.role != "system" && msg.role != "developer") continue;
      system += (system.empty() ? "" : "\n\n") + msg.text();
    }
    w.text(system);
    if (tools.is_array() && !tools.empty()) {
      if (!system.empty()) w.text("\n\n");
      write_tools_section(w, tools, m_);
    }
    bool last_user = false, in_tool = false;
    for (const auto& msg : msgs) {
      if (msg.role == "user") {
        w.control(m_.user);
        w.text(msg.text());
        last_user = true;
        in_tool = false;
      } else if (msg.role == "assistant") {
        if (last_user) {
          w.control(m_.assistant);
          w.control(m_.end_think);  // past turns are rendered without their reasoning
        }
        std::string content = msg.text();
        if (const size_t p = content.find("</think>"); p != std::string::npos && !in_tool) content.erase(0, p + 8);
        w.text(content);
        if (!msg.tool_calls.empty()) {
          w.control(m_.calls_begin);
          for (const auto& call : msg.tool_calls) {
            w.control(m_.call_begin);
            w.text(call.name);
            w.control(m_.tool_sep);
            w.text(call.arguments);
            w.control(m_.call_end);
          }
          w.control(m_.calls_end);
        }
        w.control(m_.eos);
        last_user = in_tool = false;
      } else if (msg.role == "tool") {
        w.control(m_.output_begin);
        w.text(msg.text());
        w.control(m_.output_end);
        last_user = false;
        in_tool = true;
      }
    }
    // After tool outputs the template adds nothing: the model continues the assistant turn directly.
    if (options.add_generation_prompt && last_user) {
      w.control(m_.assistant);
      w.control(options.thinking ? m_.think : m_.end_think);
    }
    return w.take();
  }

  std::string render_text(const json& messages, const ordered_json& tools,
                          const ChatOptions& options) const override {
    return tok_.decode(render(messages, tools, options));
  }
  std::vector<int32_t> stop_token_ids() const override { return {m_.eos}; }
  // The generation prompt ends with <think> when thinking is on (after tool outputs nothing is added: no reasoning).
  bool reasoning_open_after(std::span<const int32_t> prompt) const override {
    return !prompt.empty() && prompt.back() == m_.think;
  }
  std::unique_ptr<ChatOutputParser> make_parser(const ChatOptions& options) const override;
  std::string describe() const override { return "built-in DeepSeek-V3.1 style (the checkpoint ships no chat_template)"; }

 private:
  Tokenizer tok_;  // a copy shares the immutable vocabulary: no lifetime coupling to the caller's object
  DsMarkers m_;
};

// Output: [reasoning </think>] content [<｜tool▁calls▁begin｜> (<｜tool▁call▁begin｜> name <｜tool▁sep｜> arguments
// <｜tool▁call▁end｜>)* <｜tool▁calls▁end｜>] <｜end▁of▁sentence｜>. Arguments stream as the model writes them. The
// DeepSeek-V3 (0324) call layout `function<｜tool▁sep｜>name\n```json\nARGS\n```` is recognized by its `function`
// type word: the call is buffered to its end, then the name and the fenced arguments are emitted.
class DeepSeekV3Parser final : public MarkerParser {
 public:
  DeepSeekV3Parser(const Tokenizer& tok, const DsMarkers& m, bool starts_in_reasoning)
      : MarkerParser(tok), m_(m), region_(starts_in_reasoning ? Region::kThink : Region::kContent) {}

 private:
  enum class Region { kThink, kContent, kCalls, kCallName, kCallArgs, kCallV3 };

  void text(std::string_view bytes) override {
    switch (region_) {
      case Region::kThink: sink_.reasoning(bytes); return;
      case Region::kCallName:
        if (name_.size() < 256) name_ += bytes;
        return;
      case Region::kCallArgs:
        args_any_ = true;
        sink_.tool_arguments(call_index_, args_utf8_.push(bytes));
        return;
      case Region::kCallV3:
        if (v3_call_.size() < (size_t{1} << 20)) v3_call_ += bytes;
        return;
      default: sink_.content(bytes); return;
    }
  }

  static std::string trimmed(std::string s) {
    s.erase(0, s.find_first_not_of(" \n"));
    s.erase(s.find_last_not_of(" \n") + 1);
    return s;
  }

  void on_marker(int32_t t) override {
    if (t == m_.think && (region_ == Region::kContent || region_ == Region::kThink)) {
      region_ = Region::kThink;
    } else if (t == m_.end_think && region_ == Region::kThink) {
      region_ = Region::kContent;
    } else if (t == m_.calls_begin && (region_ == Region::kThink || region_ == Region::kContent)) {
      region_ = Region::kCalls;
    } else if (t == m_.call_begin && region_ == Region::kCalls) {
      name_.clear();
      region_ = Region::kCallName;
    } else if (t == m_.tool_sep && region_ == Region::kCallName) {
      const std::string name = trimmed(sanitize_utf8(name_));
      if (name == "function") {  // DeepSeek-V3 layout: the name follows on the next line
        v3_call_.clear();
        region_ = Region::kCallV3;
        return;
      }
      call_index_ = n_calls_++;
      sink_.tool_start(call_index_, fmt::format("call_{}", call_index_), name);
      args_any_ = false;
      region_ = Region::kCallArgs;
    } else if (t == m_.call_end) {
      end_call();
    } else if (t == m_.calls_end || t == m_.eos) {
      end_call();
      region_ = Region::kContent;
    }  // anything else (a stray marker, another special token) carries no text: skipped
  }

  // name\n```json\nARGS\n``` -> the call (arguments "{}" when the fence is missing or empty).
  void emit_v3_call() {
    const std::string body = sanitize_utf8(v3_call_);
    const size_t nl = body.find('\n');
    const std::string name = trimmed(body.substr(0, nl));
    std::string args;
    if (nl != std::string::npos) {
      args = body.substr(nl + 1);
      if (args.rfind("```json", 0) == 0) args.erase(0, 7);
      const size_t fence = args.rfind("```");
      if (fence != std::string::npos) args.erase(fence);
      args = trimmed(args);
    }
    call_index_ = n_calls_++;
    sink_.tool_start(call_index_, fmt::format("call_{}", call_index_), name);
    sink_.tool_arguments(call_index_, args.empty() ? "{}" : args);
  }

  void end_call() override {
    if (region_ == Region::kCallV3) emit_v3_call();
    if (region_ == Region::kCallArgs) {
      sink_.tool_arguments(call_index_, args_utf8_.flush());
      if (!args_any_) sink_.tool_arguments(call_index_, "{}");
    }
    if (region_ == Region::kCallArgs || region_ == Region::kCallName || region_ == Region::kCallV3) {
      region_ = Region::kCalls;
    }
  }

  DsMarkers m_;
  Region region_;
  std::string name_, v3_call_;
  Utf8Assembler args_utf8_;
  int n_calls_ = 0, call_index_ = 0;
  bool args_any_ = false;
};

std::unique_ptr<ChatOutputParser> DeepSeekV3ChatFormat::make_parser(const ChatOptions& options) const {
  return std::make_unique<DeepSeekV3Parser>(tok_, m_, options.starts_in_reasoning.value_or(options.thinking));
}

}  // namespace

std::unique_ptr<ChatFormat> make_deepseek_v3_chat_format(const Tokenizer& tok) {
  return std::make_unique<DeepSeekV3ChatFormat>(tok);
}

std::unique_ptr<ChatOutputParser> make_deepseek_v3_parser(const Tokenizer& tok, bool starts_in_reasoning) {
  return std::make_unique<DeepSeekV3Parser>(tok, DsMarkers::for_parser(tok), starts_in_reasoning);
}

}  // namespace bg
