// `batchgen tokenize` / `batchgen detokenize`: the checkpoint's tokenizer (and chat format) without loading weights —
// text -> ids (plain, with special-token strings matched, with the post-processor's BOS, or a chat message rendered
// with the model's format) and ids -> text.
#include <iostream>
#include <iterator>

#include "core/error.h"
#include "server/chat/chat_format.h"
#include "server/tokenizer/tokenizer.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace bg::tools {
namespace {

struct TokenizeArgs {
  std::string model_dir;
  std::string text;
  bool text_given = false;
  bool special = false, add_template = false, chat = false, print_prompt = false, thinking = false;
  std::string chat_template;
};

std::string read_stdin() {
  std::string s((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  return s;
}

void print_ids(const std::vector<int32_t>& ids) {
  for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? "," : "") << ids[i];
  std::cout << "\n";
}

void run_tokenize(const TokenizeArgs& a) {
  const std::string text = a.text_given ? a.text : read_stdin();
  const Tokenizer tok = Tokenizer::load(a.model_dir);
  BG_CHECK(a.chat || (!a.print_prompt && a.chat_template.empty() && !a.thinking),
           "tokenize: --print-prompt, --chat-template and --thinking need --chat");
  if (!a.chat) {
    std::vector<int32_t> ids = a.special ? tok.encode_with_special(text) : tok.encode(text);
    print_ids(a.add_template ? tok.with_template(ids) : ids);
    return;
  }
  const auto fmt = ChatFormat::for_model(a.model_dir, tok, a.chat_template);
  ChatOptions opt;
  opt.thinking = a.thinking || fmt->default_thinking();
  const nlohmann::json messages = nlohmann::json::array({{{"role", "user"}, {"content", text}}});
  if (a.print_prompt) {
    std::cout << fmt->render_text(messages, nullptr, opt) << "\n";
    return;
  }
  print_ids(fmt->render(messages, nullptr, opt));
}

struct DetokenizeArgs {
  std::string model_dir;
  std::string ids;
  bool skip_special = false;
};

void run_detokenize(const DetokenizeArgs& a) {
  const Tokenizer tok = Tokenizer::load(a.model_dir);
  std::vector<int32_t> ids = parse_id_list(a.ids, "ids");
  for (int32_t id : ids) {
    BG_CHECK(tok.is_known(id), "detokenize: id {} is not in the tokenizer's vocabulary (size {})", id, tok.vocab_size());
  }
  IncrementalDetokenizer detok(tok, a.skip_special);
  std::string out;
  for (int32_t id : ids) out += detok.push(id);
  std::cout << out << detok.flush() << "\n";
}

}  // namespace

void register_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  auto* cmd = app.add_subcommand("tokenize", "Text -> token ids with the checkpoint's tokenizer (no weights loaded)");
  cmd->add_option("--model", a->model_dir, "Checkpoint directory (tokenizer.json or tiktoken.model, config.json)")
      ->required();
  cmd->add_option("text", a->text, "Text to tokenize (default: standard input)")
      ->each([a](const std::string&) { a->text_given = true; });
  cmd->add_flag("--special", a->special, "Match special-token strings (as a rendered chat template is encoded)");
  cmd->add_flag("--add-special-tokens", a->add_template, "Add what the tokenizer's post-processor adds (e.g. BOS)");
  cmd->add_flag("--chat", a->chat, "Render the text as a user message with the model's chat format");
  cmd->add_flag("--print-prompt", a->print_prompt, "With --chat: print the rendered prompt text instead of ids");
  cmd->add_flag("--thinking", a->thinking, "With --chat: render with the reasoning channel on");
  cmd->add_option("--chat-template", a->chat_template, "With --chat: a Jinja chat template file instead of the "
                                                       "checkpoint's");
  cmd->callback([a] { run_tokenize(*a); });

  auto d = std::make_shared<DetokenizeArgs>();
  auto* dcmd = app.add_subcommand("detokenize", "Token ids -> text with the checkpoint's tokenizer");
  dcmd->add_option("--model", d->model_dir, "Checkpoint directory")->required();
  dcmd->add_option("ids", d->ids, "Comma-separated token ids")->required();
  dcmd->add_flag("--skip-special", d->skip_special, "Leave special tokens out of the text");
  dcmd->callback([d] { run_detokenize(*d); });
}

}  // namespace bg::tools
