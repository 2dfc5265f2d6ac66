// The checkpoint's own chat template as a ChatFormat: the Jinja template renders the request (as transformers'
// apply_chat_template does) and the text is encoded with every added token matched; output parsing picks the parser
// for the vocabulary's markers (Kimi-K2 tool calls, DeepSeek tool calls, Kimi-K3 XTML, or plain text + <think>).
#include <fmt/format.h>

#include <algorithm>
#include <fstream>

#include "core/error.h"
#include "server/chat/chat_format.h"
#include "server/chat/chat_messages.h"
#include "server/chat/delta_sink.h"
#include "server/chat/jinja/jinja.h"

namespace bg {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

std::optional<int32_t> id_of(const Tokenizer& tok, std::string_view name) { return tok.special_id(name); }

// Kimi-K2: [<think> reasoning </think>] content [<|tool_calls_section_begin|> (<|tool_call_begin|> ID
// <|tool_call_argument_begin|> ARGS <|tool_call_end|>)* <|tool_calls_section_end|>] <|im_end|>, ID =
// "functions.NAME:INDEX". Arguments stream verbatim; the call id is the model's ID (the template writes it back).
class KimiK2Parser final : public MarkerParser {
 public:
  KimiK2Parser(const Tokenizer& tok, bool starts_in_reasoning)
      : MarkerParser(tok), region_(starts_in_reasoning ? Region::kThink : Region::kContent) {
    auto need = [&](std::string_view n) {
      auto id = id_of(tok, n);
      BG_CHECK(id.has_value(), "Kimi-K2 chat output: the tokenizer has no token '{}'", n);
      return *id;
    };
    section_begin_ = need("<|tool_calls_section_begin|>");
    section_end_ = need("<|tool_calls_section_end|>");
    call_begin_ = need("<|tool_call_begin|>");
    argument_begin_ = need("<|tool_call_argument_begin|>");
    call_end_ = need("<|tool_call_end|>");
    im_end_ = id_of(tok, "<|im_end|>").value_or(-1);
    think_ = id_of(tok, "<think>").value_or(-1);
    end_think_ = id_of(tok, "</think>").value_or(-1);
  }

 private:
  enum class Region { kThink, kContent, kSection, kCallId, kCallArgs };

  void text(std::string_view bytes) override {
    switch (region_) {
      case Region::kThink: sink_.reasoning(bytes); return;
      case Region::kContent: sink_.content(bytes); return;
      case Region::kCallId:
        if (id_.size() < 256) id_ += bytes;
        return;
      case Region::kCallArgs:
        args_any_ = true;
        sink_.tool_arguments(index_, args_utf8_.push(bytes));
        return;
      case Region::kSection: return;  // separators between calls carry nothing
    }
  }

  void on_marker(int32_t t) override {
    if (t == think_ && region_ == Region::kContent) {
      region_ = Region::kThink;
    } else if (t == end_think_ && region_ == Region::kThink) {
      region_ = Region::kContent;
    } else if (t == section_begin_ && (region_ == Region::kContent || region_ == Region::kThink)) {
      region_ = Region::kSection;
    } else if (t == call_begin_ && region_ == Region::kSection) {
      id_.clear();
      region_ = Region::kCallId;
    } else if (t == argument_begin_ && region_ == Region::kCallId) {
      std::string id = sanitize_utf8(id_);
      id.erase(0, id.find_first_not_of(" \n"));
      id.erase(id.find_last_not_of(" \n") + 1);
      std::string name = id.rfind("functions.", 0) == 0 ? id.substr(10) : id;
      if (const size_t colon = name.rfind(':'); colon != std::string::npos) name.erase(colon);
      index_ = n_calls_++;
      sink_.tool_start(index_, id.empty() ? fmt::format("call_{}", index_) : id, name);
      args_any_ = false;
      region_ = Region::kCallArgs;
    } else if (t == call_end_) {
      end_call();
    } else if (t == section_end_ || t == im_end_) {
      end_call();
      region_ = Region::kContent;
    }
  }

  void end_call() override {
    if (region_ == Region::kCallArgs) {
      sink_.tool_arguments(index_, args_utf8_.flush());
      if (!args_any_) sink_.tool_arguments(index_, "{}");
    }
    if (region_ == Region::kCallArgs || region_ == Region::kCallId) region_ = Region::kSection;
  }

  Region region_;
  int32_t section_begin_, section_end_, call_begin_, argument_begin_, call_end_, im_end_, think_, end_think_;
  std::string id_;
  Utf8Assembler args_utf8_;
  int n_calls_ = 0, index_ = 0;
  bool args_any_ = false;
};

// No tool-call markers: text is content, or reasoning between <think> and </think> when the vocabulary has them.
class PlainParser : public ChatOutputParser {
 public:
  PlainParser(const Tokenizer& tok, bool starts_in_reasoning)
      : tok_(tok), think_(id_of(tok, "<think>").value_or(-1)), end_think_(id_of(tok, "</think>").value_or(-1)),
        reasoning_(starts_in_reasoning) {}
  ChatDelta push(int32_t token) override {
    if (!tok_.is_known(token)) {
      emit(kReplacementChar);
    } else if (!tok_.is_control(token)) {
      emit(tok_.token_bytes(token));
    } else if (token == think_ || token == end_think_) {
      sink_.flush_text();
      reasoning_ = token == think_;
    }
    return sink_.take();
  }
  ChatDelta finish() override {
    sink_.flush_text();
    return sink_.take();
  }

 private:
  void emit(std::string_view b) { reasoning_ ? sink_.reasoning(b) : sink_.content(b); }
  Tokenizer tok_;
  int32_t think_, end_think_;
  bool reasoning_;
  DeltaSink sink_;
};

class TemplateChatFormat : public ChatFormat {
 public:
  TemplateChatFormat(const Tokenizer& tok, const std::string& source, const std::string& name,
                     const std::filesystem::path& model_dir)
      : tok_(tok), template_(source, name), name_(name) {
    auto add_stop = [&](int32_t id) {
      if (id >= 0 && std::find(stops_.begin(), stops_.end(), id) == stops_.end()) stops_.push_back(id);
    };
    add_stop(tok.eos_id());
    for (const char* marker : {"<|im_end|>", "<｜end▁of▁sentence｜>"}) add_stop(id_of(tok, marker).value_or(-1));
    if (!model_dir.empty()) {
      std::ifstream in(model_dir / "generation_config.json");
      if (in.good()) {
        const json g = json::parse(in, nullptr, /*allow_exceptions=*/false);
        const json eos = g.is_object() ? g.value("eos_token_id", json()) : json();
        for (const json& e : eos.is_array() ? eos : json::array({eos})) {
          if (e.is_number_integer() && tok.is_known(e.get<int32_t>())) add_stop(e.get<int32_t>());
        }
      }
    }
    BG_CHECK(!stops_.empty(), "{}: the tokenizer has no end-of-sequence token to stop generation at", name);
  }

  std::vector<int32_t> render(const json& messages, const ordered_json& tools,
                              const ChatOptions& options) const override {
    return tok_.encode_with_special(render_text(messages, tools, options));
  }

  std::string render_text(const json& messages, const ordered_json& tools,
                          const ChatOptions& options) const override {
    const std::vector<ChatMessage> msgs = parse_chat_messages(messages);  // validation: errors name the field
    validate_chat_tools(tools);
    if (!options.reasoning_effort.empty()) {
      BG_CHECK(std::find(std::begin(kReasoningEfforts), std::end(kReasoningEfforts), options.reasoning_effort) !=
                   std::end(kReasoningEfforts),
               "reasoning_effort: unsupported value '{}' (low, medium, high, max)", options.reasoning_effort);
    }
    // Ordered: the tools keep the client's key order, as Python dicts do for the reference template engines.
    ordered_json vars = ordered_json::object();
    json list = json::array();
    for (size_t i = 0; i < messages.size(); ++i) {
      json m = messages[i];
      if (m.contains("content") && m["content"].is_array()) m["content"] = msgs[i].text();  // text parts, joined
      list.push_back(std::move(m));
    }
    vars["messages"] = std::move(list);
    if (!tools.is_null()) vars["tools"] = tools;
    vars["add_generation_prompt"] = options.add_generation_prompt;
    vars["thinking"] = options.thinking;
    vars["enable_thinking"] = options.thinking;
    if (!options.reasoning_effort.empty()) vars["reasoning_effort"] = options.reasoning_effort;
    for (const auto& [key, id] : {std::pair{"bos_token", tok_.bos_id()}, std::pair{"eos_token", tok_.eos_id()},
                                  std::pair{"pad_token", tok_.pad_id()}}) {
      if (id >= 0) vars[key] = std::string(tok_.token_bytes(id));
    }
    return template_.render(vars);
  }

  std::vector<int32_t> stop_token_ids() const override { return stops_; }
  bool default_thinking() const override { return false; }

  bool reasoning_open_after(std::span<const int32_t> prompt) const override {
    const auto think = id_of(tok_, "<think>");
    return think.has_value() && !prompt.empty() && prompt.back() == *think;
  }

  std::unique_ptr<ChatOutputParser> make_parser(const ChatOptions& options) const override {
    const bool starts = options.starts_in_reasoning.value_or(options.thinking && id_of(tok_, "<think>").has_value());
    if (id_of(tok_, "<|tool_calls_section_begin|>")) return make_kimi_k2_parser(tok_, starts);
    if (id_of(tok_, "<｜tool▁calls▁begin｜>")) return make_deepseek_v3_parser(tok_, starts);
    if (id_of(tok_, "<|open|>") && id_of(tok_, "<|end_of_msg|>")) {
      ChatOptions o = options;
      o.starts_in_reasoning = starts;
      return make_kimi_k3_chat_format(tok_)->make_parser(o);
    }
    return std::make_unique<PlainParser>(tok_, starts);
  }

  std::string describe() const override { return "chat template from " + name_; }

 private:
  Tokenizer tok_;
  jinja::Template template_;
  std::string name_;
  std::vector<int32_t> stops_;
};

}  // namespace

std::unique_ptr<ChatFormat> make_template_chat_format(const Tokenizer& tok, const std::string& source,
                                                      const std::string& name,
                                                      const std::filesystem::path& model_dir) {
  return std::make_unique<TemplateChatFormat>(tok, source, name, model_dir);
}

std::unique_ptr<ChatOutputParser> make_kimi_k2_parser(const Tokenizer& tok, bool starts_in_reasoning) {
  return std::make_unique<KimiK2Parser>(tok, starts_in_reasoning);
}

}  // namespace bg
