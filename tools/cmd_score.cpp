// `batchgen score`: one prefill over the first N tokens, then the rest one decode step at a time; writes every logit
// row to a safetensors file (tensor `logits` float32 [T, vocab], row t = logits after token t).
#include <fmt/ranges.h>

#include <chrono>

#include "core/error.h"
#include "core/log.h"
#include "formats/safetensors.h"
#include "model/model.h"
#include "model/step_model.h"
#include "server/tokenizer/tokenizer.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/parallel_cli.h"

namespace bg::tools {
namespace {

struct ScoreArgs {
  std::string model_dir;
  std::string tokens;
  std::string text;
  int64_t prefill = -1;
  std::string out;
  std::string device = "cpu";
  ParallelArgs par;
  std::string weight_store;
  double resident_experts = 1.0;
  std::string expert_trace;
  std::string write_expert_trace;
  std::string distributed_weight_config;
};

void run_score(const ScoreArgs& a) {
  BG_CHECK(a.tokens.empty() != a.text.empty(), "score: give exactly one of --tokens and --text");
  std::vector<int32_t> tokens;
  if (!a.text.empty()) {
    const Tokenizer tok = Tokenizer::load(a.model_dir);
    tokens = tok.with_template(tok.encode(a.text));  // as Hugging Face's tokenizer(text): BOS where the file says
    log::info("score: --text is {} tokens: {}", tokens.size(), fmt::join(tokens, ","));
  } else {
    tokens = parse_id_list(a.tokens, "--tokens");
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t prefill = a.prefill < 0 ? n : a.prefill;
  BG_CHECK(a.write_expert_trace.empty() || a.resident_experts < 1.0, "--write-expert-trace needs --resident-experts "
           "below 1: the streamed-expert pool keeps the routing counts (0 counts every expert)");
  BG_CHECK(prefill >= 1 && prefill <= n, "--prefill {} must be in [1, {}] (the number of tokens)", prefill, n);
  LoadOptions options{.device = a.device, .weight_store = a.weight_store,
                      .distributed_weight_config = a.distributed_weight_config,
                      .resident_experts = a.resident_experts, .expert_trace = a.expert_trace};
  if (LocalRanks::runs_on_other_node(a.par)) {  // node k > 0: its ranks only; node 0 prints the result
    LocalRanks::run_node(a.par, a.model_dir, options);
    return;
  }
  std::unique_ptr<LocalRanks> ranks = LocalRanks::start(a.par, a.model_dir, options, {1, n});  // null: one rank
  if (ranks) options.ranks = ranks->context();
  auto model = load_model(a.model_dir, options);
  const int64_t V = model->info().vocab_size;
  HostTensor logits(DType::kF32, {n, V});
  auto* out = reinterpret_cast<float*>(logits.data());
  auto state = make_state(*model, 1, n);
  auto seq = state->new_sequence(n);
  auto t0 = std::chrono::steady_clock::now();
  std::span<const int32_t> all(tokens);
  model->forward(*seq, all.subspan(0, static_cast<size_t>(prefill)), out);
  for (int64_t t = prefill; t < n; ++t) model->forward(*seq, all.subspan(static_cast<size_t>(t), 1), out + t * V);
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (ranks) ranks->finish(*model);
  write_safetensors(a.out, {{"logits", logits.view("logits")}});
  if (!a.write_expert_trace.empty()) {
    const auto* sm = dynamic_cast<const StepModel*>(model.get());
    BG_CHECK(sm != nullptr && sm->expert_stream() != nullptr, "--write-expert-trace: this model streams no experts");
    moe::write_expert_trace(a.write_expert_trace, sm->expert_stream()->n_experts(),
                            sm->expert_stream()->routing_counts());
    log::info("routing counts of {} MoE layers (this rank's experts) -> {}",
              sm->expert_stream()->routing_counts().size(), a.write_expert_trace);
  }
  log::info("scored {} tokens ({} prefill + {} decode steps) in {:.1f} ms -> {}", n, prefill, n - prefill, ms, a.out);
}

}  // namespace

void register_score(CLI::App& app) {
  auto args = std::make_shared<ScoreArgs>();
  auto* cmd = app.add_subcommand("score", "Prefill + teacher-forced decode over given token ids; write all logits");
  cmd->add_option("--model", args->model_dir, "Checkpoint directory (config.json + safetensors)")->required();
  cmd->add_option("--tokens", args->tokens, "Comma-separated token ids, e.g. 5,17,3");
  cmd->add_option("--text", args->text, "Text to score instead of --tokens (the checkpoint's tokenizer; BOS where it "
                                        "adds one)");
  cmd->add_option("--prefill", args->prefill, "Tokens in the first (prefill) forward; default: all");
  cmd->add_option("--out", args->out, "Output .safetensors (tensor 'logits' float32 [T, vocab])")->required();
  cmd->add_option("--device", args->device, "Backend: cpu (fp32 reference) or cuda (bf16 on the GPU)")->check(CLI::IsMember({"cpu", "cuda"}));
  add_parallel_flags(cmd, args->par, true);
  add_weight_source_options(cmd, args->weight_store, args->distributed_weight_config);
  add_expert_residency_options(cmd, args->resident_experts, args->expert_trace);
  cmd->add_option("--write-expert-trace", args->write_expert_trace, "After scoring, write the routing counts seen by "
                  "the streamed-expert pool as an --expert-trace file (needs --resident-experts below 1)");
  cmd->callback([args] { run_score(*args); });
}

}  // namespace bg::tools
