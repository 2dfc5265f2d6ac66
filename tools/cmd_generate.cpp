// `batchgen generate`: prefill the prompt ids, then sample up to --max-tokens ids; prints them comma-separated.
#include <iostream>
#include <random>

#include "core/error.h"
#include "model/model.h"
#include "ops/sampling/sampling.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/parallel_cli.h"

namespace bg::tools {
namespace {

struct GenerateArgs {
  std::string model_dir;
  std::string prompt_ids;
  int64_t max_tokens = 16;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int64_t top_k = 0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::string device = "cpu";
  ParallelArgs par;
};

void run_generate(const GenerateArgs& a) {
  BG_CHECK(a.max_tokens >= 1, "--max-tokens {} must be >= 1", a.max_tokens);
  BG_CHECK(a.temperature >= 0.0f, "--temperature {} must be >= 0", a.temperature);
  BG_CHECK(a.top_p > 0.0f && a.top_p <= 1.0f, "--top-p {} must be in (0, 1]", a.top_p);
  BG_CHECK(a.top_k >= 0, "--top-k {} must be >= 0", a.top_k);
  std::vector<int32_t> prompt = parse_id_list(a.prompt_ids, "--prompt-ids");
  const int64_t total = static_cast<int64_t>(prompt.size()) + a.max_tokens;
  LoadOptions options{.max_sequences = 1, .max_total_tokens = total, .device = a.device};
  std::unique_ptr<LocalRanks> ranks = LocalRanks::start(a.par, a.model_dir, options);  // null: one rank
  if (ranks) options.ranks = ranks->context();
  auto model = load_model(a.model_dir, options);
  const int64_t V = model->info().vocab_size;
  BG_CHECK(total <= model->info().max_position_embeddings, "prompt ({}) + --max-tokens ({}) exceeds the model's "
           "context of {}", prompt.size(), a.max_tokens, model->info().max_position_embeddings);
  ops::SamplingParams sp{a.temperature, a.top_k, a.top_p};
  std::mt19937_64 rng(a.seed);
  auto seq = model->new_sequence();
  std::vector<float> logits(prompt.size() * static_cast<size_t>(V));
  model->forward(*seq, prompt, logits.data());
  int32_t next = ops::sample_token(sp, logits.data() + (prompt.size() - 1) * static_cast<size_t>(V), V, rng);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < a.max_tokens; ++i) {
    out.push_back(next);
    if (!a.ignore_eos && next == model->info().eos_token_id) break;
    if (i + 1 == a.max_tokens) break;
    model->forward(*seq, std::span<const int32_t>(&next, 1), logits.data());
    next = ops::sample_token(sp, logits.data(), V, rng);
  }
  if (ranks) ranks->finish(*model);
  for (size_t i = 0; i < out.size(); ++i) std::cout << (i ? "," : "") << out[i];
  std::cout << "\n";
}

}  // namespace

void register_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  auto* cmd = app.add_subcommand("generate", "Generate token ids from prompt ids (greedy or sampled)");
  cmd->add_option("--model", args->model_dir, "Checkpoint directory")->required();
  cmd->add_option("--prompt-ids", args->prompt_ids, "Comma-separated prompt token ids")->required();
  cmd->add_option("--max-tokens", args->max_tokens, "Maximum new tokens (default 16)");
  cmd->add_option("--temperature", args->temperature, "0 = greedy (default)");
  cmd->add_option("--top-p", args->top_p, "Nucleus cut in (0, 1] (default 1)");
  cmd->add_option("--top-k", args->top_k, "Keep the k most likely ids; 0 = all (default)");
  cmd->add_option("--seed", args->seed, "Sampling seed (default 0)");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "Do not stop at the end-of-sequence id");
  cmd->add_option("--device", args->device, "Backend: cpu (fp32 reference) or cuda (bf16 on the GPU)")->check(CLI::IsMember({"cpu", "cuda"}));
  add_parallel_flags(cmd, args->par, false);
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace bg::tools
