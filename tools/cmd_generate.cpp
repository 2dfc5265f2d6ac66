// `batchgen generate`: prefill a prompt (ids, text, or a chat message rendered with the model's chat format), then
// sample up to --max-tokens ids. Ids in -> ids out (comma-separated); text in -> text streamed out as it is generated,
// with a chat answer's reasoning and answer labelled.
#include <iostream>
#include <random>

#include "core/error.h"
#include "model/model.h"
#include "ops/sampling/sampling.h"
#include "server/chat/chat_format.h"
#include "server/tokenizer/tokenizer.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/parallel_cli.h"

namespace bg::tools {
namespace {

struct GenerateArgs {
  std::string model_dir;
  std::string prompt_ids;
  std::string prompt;
  std::string system;
  std::string chat_template;
  std::string reasoning_effort;
  bool chat = false;
  bool thinking = false, no_thinking = false;
  int64_t max_tokens = 16;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int64_t top_k = 0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::string device = "cpu";
  ParallelArgs par;
  std::string weight_store;
  double resident_experts = 1.0;
  std::string expert_trace;
  std::string distributed_weight_config;
};

// Where generated text goes: ids (comma-separated), plain text, or chat deltas with labels.
class Output {
 public:
  virtual ~Output() = default;
  virtual void token(int32_t id) = 0;
  virtual void finish() = 0;
};

class IdsOutput : public Output {
 public:
  void token(int32_t id) override { std::cout << (n_++ ? "," : "") << id; }
  void finish() override { std::cout << "\n"; }

 private:
  int n_ = 0;
};

class TextOutput : public Output {
 public:
  explicit TextOutput(const Tokenizer& tok) : detok_(tok) {}
  void token(int32_t id) override { std::cout << detok_.push(id) << std::flush; }
  void finish() override { std::cout << detok_.flush() << "\n"; }

 private:
  IncrementalDetokenizer detok_;
};

// Reasoning and answer labelled as they start ("[reasoning]", "[answer]"); tool calls listed at the end.
class ChatOutput : public Output {
 public:
  explicit ChatOutput(std::unique_ptr<ChatOutputParser> parser) : parser_(std::move(parser)) {}
  void token(int32_t id) override { print(parser_->push(id)); }
  void finish() override {
    print(parser_->finish());
    std::cout << "\n";
    for (const ToolCallDelta& c : calls_) std::cout << "[tool call] " << c.name << " " << c.arguments << "\n";
    if (section_ != Section::kAnswer && calls_.empty()) {
      std::cout << "[answer]\n(none: generation stopped " << (section_ == Section::kReasoning ? "inside the reasoning "
                   "channel; raise --max-tokens or use --no-thinking)" : "before any text)") << "\n";
    }
  }

 private:
  enum class Section { kNone, kReasoning, kAnswer };
  void label(Section s, const char* text) {
    if (section_ == s) return;
    std::cout << (section_ == Section::kNone ? "" : "\n") << text << "\n";
    section_ = s;
  }
  void print(const ChatDelta& d) {
    if (!d.reasoning.empty()) {
      label(Section::kReasoning, "[reasoning]");
      std::cout << d.reasoning;
    }
    if (!d.content.empty()) {
      label(Section::kAnswer, "[answer]");
      std::cout << d.content;
    }
    for (const ToolCallDelta& t : d.tool_calls) {
      if (t.index >= static_cast<int>(calls_.size())) calls_.resize(static_cast<size_t>(t.index) + 1);
      ToolCallDelta& c = calls_[static_cast<size_t>(t.index)];
      if (!t.name.empty()) c.name = t.name;
      c.arguments += t.arguments;
    }
    std::cout << std::flush;
  }
  std::unique_ptr<ChatOutputParser> parser_;
  std::vector<ToolCallDelta> calls_;
  Section section_ = Section::kNone;
};

struct Prepared {
  std::vector<int32_t> prompt;
  std::vector<int32_t> stop_ids;
  std::unique_ptr<Output> out;
};

Prepared prepare(const GenerateArgs& a, int64_t model_eos) {
  Prepared p;
  BG_CHECK(a.prompt_ids.empty() != a.prompt.empty(), "generate: give exactly one of --prompt-ids and --prompt");
  BG_CHECK(!a.chat || !a.prompt.empty(), "generate: --chat renders --prompt TEXT as a user message");
  BG_CHECK(a.chat || (a.system.empty() && a.chat_template.empty() && a.reasoning_effort.empty() && !a.thinking &&
                      !a.no_thinking),
           "generate: --system, --chat-template, --reasoning-effort and --thinking/--no-thinking need --chat");
  if (model_eos >= 0) p.stop_ids.push_back(static_cast<int32_t>(model_eos));
  if (!a.prompt_ids.empty()) {
    p.prompt = parse_id_list(a.prompt_ids, "--prompt-ids");
    p.out = std::make_unique<IdsOutput>();
    return p;
  }
  const Tokenizer tok = Tokenizer::load(a.model_dir);
  if (!a.chat) {
    p.prompt = tok.with_template(tok.encode(a.prompt));  // as Hugging Face's tokenizer(text): BOS where the file says
    if (tok.eos_id() >= 0) p.stop_ids.push_back(tok.eos_id());
    p.out = std::make_unique<TextOutput>(tok);
    return p;
  }
  const auto fmt = ChatFormat::for_model(a.model_dir, tok, a.chat_template);
  ChatOptions opt;
  opt.thinking = a.thinking ? true : a.no_thinking ? false : fmt->default_thinking();
  opt.reasoning_effort = a.reasoning_effort;
  nlohmann::json messages = nlohmann::json::array();
  if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
  messages.push_back({{"role", "user"}, {"content", a.prompt}});
  p.prompt = fmt->render(messages, nullptr, opt);
  opt.starts_in_reasoning = fmt->reasoning_open_after(p.prompt);
  for (int32_t id : fmt->stop_token_ids()) p.stop_ids.push_back(id);
  p.out = std::make_unique<ChatOutput>(fmt->make_parser(opt));
  return p;
}

void run_generate(const GenerateArgs& a) {
  BG_CHECK(a.max_tokens >= 1, "--max-tokens {} must be >= 1", a.max_tokens);
  BG_CHECK(a.temperature >= 0.0f, "--temperature {} must be >= 0", a.temperature);
  BG_CHECK(a.top_p > 0.0f && a.top_p <= 1.0f, "--top-p {} must be in (0, 1]", a.top_p);
  BG_CHECK(a.top_k >= 0, "--top-k {} must be >= 0", a.top_k);
  BG_CHECK(!(a.thinking && a.no_thinking), "generate: --thinking and --no-thinking contradict each other");
  // Tokenize before loading the model: a bad prompt or template fails in milliseconds, not after the load.
  Prepared p = prepare(a, -1);
  BG_CHECK(!p.prompt.empty(), "generate: the prompt is empty");
  const int64_t total = static_cast<int64_t>(p.prompt.size()) + a.max_tokens;
  LoadOptions options{.device = a.device, .weight_store = a.weight_store,
                      .distributed_weight_config = a.distributed_weight_config,
                      .resident_experts = a.resident_experts, .expert_trace = a.expert_trace};
  if (LocalRanks::runs_on_other_node(a.par)) {  // node k > 0: its ranks only; node 0 prints the result
    LocalRanks::run_node(a.par, a.model_dir, options);
    return;
  }
  std::unique_ptr<LocalRanks> ranks = LocalRanks::start(a.par, a.model_dir, options, {1, total});  // null: one rank
  if (ranks) options.ranks = ranks->context();
  auto model = load_model(a.model_dir, options);
  const int64_t V = model->info().vocab_size;
  if (model->info().eos_token_id >= 0) p.stop_ids.push_back(static_cast<int32_t>(model->info().eos_token_id));
  BG_CHECK(total <= model->info().max_position_embeddings, "prompt ({}) + --max-tokens ({}) exceeds the model's "
           "context of {}", p.prompt.size(), a.max_tokens, model->info().max_position_embeddings);
  for (int32_t id : p.prompt) {
    BG_CHECK(id >= 0 && id < V, "prompt id {} is outside the model's vocabulary of {}", id, V);
  }
  ops::SamplingParams sp{a.temperature, a.top_k, a.top_p};
  std::mt19937_64 rng(a.seed);
  auto state = make_state(*model, 1, total);
  auto seq = state->new_sequence(total);
  std::vector<float> logits(p.prompt.size() * static_cast<size_t>(V));
  model->forward(*seq, p.prompt, logits.data());
  int32_t next = ops::sample_token(sp, logits.data() + (p.prompt.size() - 1) * static_cast<size_t>(V), V, rng);
  for (int64_t i = 0; i < a.max_tokens; ++i) {
    const bool stop = !a.ignore_eos && std::find(p.stop_ids.begin(), p.stop_ids.end(), next) != p.stop_ids.end();
    p.out->token(next);
    if (stop || i + 1 == a.max_tokens) break;
    model->forward(*seq, std::span<const int32_t>(&next, 1), logits.data());
    next = ops::sample_token(sp, logits.data(), V, rng);
  }
  if (ranks) ranks->finish(*model);
  p.out->finish();
}

}  // namespace

void register_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  auto* cmd = app.add_subcommand("generate", "Generate from prompt ids (ids out) or a text prompt (text streamed out; "
                                             "--chat renders it with the model's chat format)");
  cmd->add_option("--model", args->model_dir, "Checkpoint directory")->required();
  cmd->add_option("--prompt-ids", args->prompt_ids, "Comma-separated prompt token ids");
  cmd->add_option("--prompt", args->prompt, "Prompt text (tokenized with the checkpoint's tokenizer)");
  cmd->add_flag("--chat", args->chat, "Send --prompt as a user message through the model's chat format; prints the "
                                      "reasoning and the answer, labelled");
  cmd->add_option("--system", args->system, "With --chat: a system message first");
  cmd->add_option("--chat-template", args->chat_template, "With --chat: a Jinja chat template file instead of the "
                                                          "checkpoint's");
  cmd->add_flag("--thinking", args->thinking, "With --chat: turn the reasoning channel on");
  cmd->add_flag("--no-thinking", args->no_thinking, "With --chat: turn the reasoning channel off");
  cmd->add_option("--reasoning-effort", args->reasoning_effort, "With --chat: low, medium, high or max")
      ->check(CLI::IsMember({"low", "medium", "high", "max"}));
  cmd->add_option("--max-tokens", args->max_tokens, "Maximum new tokens (default 16)");
  cmd->add_option("--temperature", args->temperature, "0 = greedy (default)");
  cmd->add_option("--top-p", args->top_p, "Nucleus cut in (0, 1] (default 1)");
  cmd->add_option("--top-k", args->top_k, "Keep the k most likely ids; 0 = all (default)");
  cmd->add_option("--seed", args->seed, "Sampling seed (default 0)");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "Do not stop at the end-of-sequence id");
  cmd->add_option("--device", args->device, "Backend: cpu (fp32 reference) or cuda (bf16 on the GPU)")->check(CLI::IsMember({"cpu", "cuda"}));
  add_parallel_flags(cmd, args->par, true);
  add_weight_source_options(cmd, args->weight_store, args->distributed_weight_config);
  add_expert_residency_options(cmd, args->resident_experts, args->expert_trace);
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace bg::tools
