// A byte-level TextModel for frontend tests: ids 0..255 are bytes; 256 <eos>, 257 <think>, 258 </think>,
// 259 <tool> (then "name:" and argument bytes), 260 </tool>. Chat renders "role: content\n" per message (then
// <think> when opens_reasoning is set).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "server/frontend/text_model.h"

namespace bg::testing {

inline constexpr int32_t kEos = 256, kThink = 257, kThinkEnd = 258, kTool = 259, kToolEnd = 260;

inline std::vector<int32_t> bytes_to_ids(const std::string& s) {
  std::vector<int32_t> out;
  for (char c : s) out.push_back(static_cast<unsigned char>(c));
  return out;
}

class FakeTextStream : public frontend::TextStream {
 public:
  std::string push(int32_t t) override { return t < 256 ? std::string(1, static_cast<char>(t)) : std::string(); }
  std::string flush() override { return ""; }
};

class FakeChatParser : public frontend::ChatStreamParser {
 public:
  FakeChatParser(bool thinking, bool starts_in_reasoning) : in_reasoning_(starts_in_reasoning), thinking_(thinking) {}
  frontend::ChatPiece push(int32_t t) override {
    frontend::ChatPiece p;
    if (t == kThink && thinking_) {
      in_reasoning_ = true;
    } else if (t == kThinkEnd) {
      in_reasoning_ = false;
    } else if (t == kTool) {
      in_tool_ = true;
      name_done_ = false;
      name_.clear();
    } else if (t == kToolEnd) {
      in_tool_ = false;
      ++tool_index_;
    } else if (t < 256) {
      const char c = static_cast<char>(t);
      if (in_tool_ && !name_done_) {
        if (c == ':') {
          name_done_ = true;
          p.tool_calls.push_back({tool_index_, "call_" + std::to_string(tool_index_), name_, ""});
        } else {
          name_ += c;
        }
      } else if (in_tool_) {
        p.tool_calls.push_back({tool_index_, "", "", std::string(1, c)});
      } else if (in_reasoning_) {
        p.reasoning += c;
      } else {
        p.content += c;
      }
    }
    return p;
  }
  frontend::ChatPiece finish() override { return {}; }

 private:
  bool in_reasoning_;
  bool thinking_;
  bool in_tool_ = false;
  bool name_done_ = false;
  std::string name_;
  int tool_index_ = 0;
};

class FakeTextModel : public frontend::TextModel {
 public:
  std::vector<int32_t> encode(std::string_view text) const override { return bytes_to_ids(std::string(text)); }
  std::vector<int32_t> encode_prompt(std::string_view text) const override { return encode(text); }  // no BOS
  std::unique_ptr<frontend::TextStream> detokenizer() const override { return std::make_unique<FakeTextStream>(); }
  std::string token_bytes(int32_t t) const override { return t < 256 ? std::string(1, static_cast<char>(t)) : ""; }
  std::vector<int32_t> render_chat(const nlohmann::json& messages, const nlohmann::ordered_json& tools,
                                   const frontend::ChatParams& params) const override {
    std::string text;
    for (const auto& m : messages) {
      BG_CHECK(m.contains("content") && m["content"].is_string(), "fake chat format: content must be a string");
      text += m["role"].get<std::string>() + ": " + m["content"].get<std::string>() + "\n";
    }
    if (!tools.empty()) text += "tools: " + std::to_string(tools.size()) + "\n";
    if (!params.thinking.value_or(true)) text += "nothink\n";
    std::vector<int32_t> ids = bytes_to_ids(text);
    if (opens_reasoning) ids.push_back(kThink);  // like a template that opens the assistant turn with <think>
    return ids;
  }
  // The prompt ends inside the reasoning channel when render_chat appended <think> (opens_reasoning).
  bool reasoning_open_after(const std::vector<int32_t>& prompt) const override {
    return !prompt.empty() && prompt.back() == kThink;
  }
  std::vector<int32_t> chat_stop_ids() const override { return {kEos}; }
  std::unique_ptr<frontend::ChatStreamParser> chat_parser(const frontend::ChatParams& p) const override {
    return std::make_unique<FakeChatParser>(p.thinking.value_or(true), p.starts_in_reasoning.value_or(false));
  }
  int64_t vocab_size() const override { return 261; }

  bool opens_reasoning = false;  // render_chat ends the prompt with <think>
};

}  // namespace bg::testing
