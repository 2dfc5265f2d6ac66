// The real TextModel: the model directory's tokenizer (tokenizer.json or tiktoken) and its chat format behind the
// frontend's seam.
#include "server/frontend/text_model.h"

#include "core/log.h"
#include "server/chat/chat_format.h"
#include "server/tokenizer/tokenizer.h"

namespace bg::frontend {

namespace {

class DetokenizerStream : public TextStream {
 public:
  explicit DetokenizerStream(const Tokenizer& tok) : detok_(tok, /*skip_special=*/true) {}
  std::string push(int32_t token) override { return detok_.push(token); }
  std::string flush() override { return detok_.flush(); }

 private:
  IncrementalDetokenizer detok_;
};

ChatPiece to_piece(ChatDelta d) {
  ChatPiece p;
  p.reasoning = std::move(d.reasoning);
  p.content = std::move(d.content);
  for (ToolCallDelta& t : d.tool_calls) {
    p.tool_calls.push_back(ToolCallPiece{t.index, std::move(t.id), std::move(t.name), std::move(t.arguments)});
  }
  return p;
}

class ParserStream : public ChatStreamParser {
 public:
  explicit ParserStream(std::unique_ptr<ChatOutputParser> parser) : parser_(std::move(parser)) {}
  ChatPiece push(int32_t token) override { return to_piece(parser_->push(token)); }
  ChatPiece finish() override { return to_piece(parser_->finish()); }

 private:
  std::unique_ptr<ChatOutputParser> parser_;
};

class ModelDirTextModel : public TextModel {
 public:
  ModelDirTextModel(const std::string& dir, const std::string& chat_template)
      : tok_(Tokenizer::load(dir)), chat_(ChatFormat::for_model(dir, tok_, chat_template)) {
    log::info("chat format: {}", chat_->describe());
  }

  std::vector<int32_t> encode(std::string_view text) const override { return tok_.encode(text); }
  std::vector<int32_t> encode_prompt(std::string_view text) const override {
    return tok_.with_template(tok_.encode(text));
  }
  std::unique_ptr<TextStream> detokenizer() const override { return std::make_unique<DetokenizerStream>(tok_); }
  std::string token_bytes(int32_t token) const override {
    return tok_.is_known(token) ? std::string(tok_.token_bytes(token)) : std::string();
  }
  std::vector<int32_t> render_chat(const nlohmann::json& messages, const nlohmann::ordered_json& tools,
                                   const ChatParams& params) const override {
    ChatOptions opt;
    opt.thinking = params.thinking.value_or(chat_->default_thinking());
    opt.reasoning_effort = params.reasoning_effort;
    opt.add_generation_prompt = true;
    return chat_->render(messages, tools, opt);
  }
  bool reasoning_open_after(const std::vector<int32_t>& prompt) const override {
    return chat_->reasoning_open_after(prompt);
  }
  std::vector<int32_t> chat_stop_ids() const override { return chat_->stop_token_ids(); }
  std::unique_ptr<ChatStreamParser> chat_parser(const ChatParams& params) const override {
    ChatOptions opt;
    opt.thinking = params.thinking.value_or(chat_->default_thinking());
    opt.reasoning_effort = params.reasoning_effort;
    opt.starts_in_reasoning = params.starts_in_reasoning;
    return std::make_unique<ParserStream>(chat_->make_parser(opt));
  }
  int64_t vocab_size() const override { return tok_.vocab_size(); }

 private:
  Tokenizer tok_;
  std::unique_ptr<ChatFormat> chat_;
};

}  // namespace

std::unique_ptr<TextModel> load_text_model(const std::string& model_dir, const std::string& chat_template) {
  return std::make_unique<ModelDirTextModel>(model_dir, chat_template);
}

}  // namespace bg::frontend
