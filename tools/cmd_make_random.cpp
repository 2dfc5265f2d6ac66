// `batchgen make-random`: writes a random-weight checkpoint in the published layout (config.json, safetensors shards,
// index, tokenizer files) for an architecture preset and weight format; see model/random_checkpoint.h.
#include "core/error.h"
#include "formats/json_fields.h"
#include "model/random_checkpoint.h"
#include "server/tokenizer/tokenizer_writer.h"
#include "tools/commands.h"

namespace bg::tools {
namespace {

struct MakeRandomArgs {
  RandomCheckpointSpec spec;
  std::string config_patch;
  std::string chat_template;  // deepseek_v3 only: the layout of the chat_template written (deepseek_v3.1 default)
  std::vector<std::string> poison;  // "LAYER:EXPERT"
};

ExpertRef parse_expert_ref(const std::string& text) {
  const size_t colon = text.find(':');
  int64_t layer = -1, expert = -1;
  size_t used_l = 0, used_e = 0;
  try {
    if (colon != std::string::npos) {
      layer = std::stoll(text.substr(0, colon), &used_l);
      expert = std::stoll(text.substr(colon + 1), &used_e);
    }
  } catch (const std::exception&) {
    layer = -1;
  }
  BG_CHECK(colon != std::string::npos && used_l == colon && used_e == text.size() - colon - 1 && layer >= 0 &&
               expert >= 0, "--poison-expert '{}': expected LAYER:EXPERT (two non-negative integers, e.g. 3:5)", text);
  return {layer, expert};
}

void run_make_random(MakeRandomArgs a) {
  for (const std::string& p : a.poison) a.spec.poison_experts.push_back(parse_expert_ref(p));
  if (!a.config_patch.empty()) {
    auto patch = nlohmann::json::parse(a.config_patch, nullptr, /*allow_exceptions=*/false);
    BG_CHECK(!patch.is_discarded() && (patch.is_object() || patch.is_array()),
             "--config-patch: '{}' is neither a JSON object nor a JSON Patch array", a.config_patch);
    a.spec.config_patch = std::move(patch);
  }
  if (a.chat_template == "kimi_k2") {  // Kimi-K2's vocabulary layout: model_type, vocabulary size, bos/eos ids
    BG_CHECK(a.spec.config_patch.is_object(), "--chat-template kimi_k2 cannot be combined with a JSON Patch array "
             "--config-patch (use an object)");
    const int64_t vocab = random_checkpoint_config(a.spec).value("vocab_size", int64_t{0});
    apply_config_patch(a.spec.config_patch, kimi_k2_config_patch(vocab));
  }
  write_random_checkpoint(a.spec);
  // The tokenizer files matching the final config's vocabulary (tokenizer.json or tiktoken.model, and
  // tokenizer_config.json with the chat template), so the checkpoint can be served with chat formatting.
  write_random_tokenizer(a.spec.arch, random_checkpoint_config(a.spec), a.spec.out_dir, a.chat_template);
}

}  // namespace

void register_make_random(CLI::App& app) {
  auto args = std::make_shared<MakeRandomArgs>();
  RandomCheckpointSpec& s = args->spec;
  auto* cmd = app.add_subcommand("make-random", "Write a random-weight checkpoint (config.json + safetensors shards)");
  cmd->add_option("--arch", s.arch, "Architecture (deepseek_v3, kimi_k3)")->required();
  cmd->add_option("--preset", s.preset,
                  "Size preset (deepseek_v3: tiny, small; kimi_k3: tiny, ep16-rank = real dims, 13 GB)")
      ->required();
  cmd->add_option("--format", s.format,
                  "Weight format (deepseek_v3: bf16 (default), f32, fp8, mxfp4; kimi_k3: mxfp4 (default, the "
                  "compressed-tensors layout of the real checkpoint), bf16, f32)");
  cmd->add_option("--seed", s.seed, "Seed of the random weights (default 0)");
  cmd->add_option("--out", s.out_dir, "Output directory (created if missing)")->required();
  cmd->add_option("--shards", s.n_shards, "Number of safetensors shards (default 2)");
  cmd->add_option("--config-patch", args->config_patch,
                  "JSON object merged over the preset's config.json, e.g. '{\"n_group\":4,\"topk_group\":2}' "
                  "(deepseek_v3) or '{\"text_config\":{\"num_experts\":32}}' (kimi_k3), or an RFC 6902 JSON Patch "
                  "array");
  cmd->add_flag("--force", s.force, "Replace the checkpoint files of a non-empty output directory");
  cmd->add_option("--chat-template", args->chat_template,
                  "deepseek_v3 only: the chat_template layout written into tokenizer_config.json: deepseek_v3.1 "
                  "(default), deepseek_v3, or kimi_k2 (also Kimi-K2's tokenizer and model_type kimi_k2)")
      ->check(CLI::IsMember({"deepseek_v3", "deepseek_v3.1", "kimi_k2"}));
  cmd->add_option("--threads", s.n_threads,
                  "Generation threads (default 0: all cores, or BG_NUM_THREADS); the output does not depend on it")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--poison-expert", args->poison,
                  "LAYER:EXPERT (repeatable): overwrite that routed expert's down projection with NaN, for "
                  "fault-containment tests (requests routed to it must fail alone; docs/GPU.md)");
  s.show_progress = true;
  cmd->callback([args] { run_make_random(*args); });
}

}  // namespace bg::tools
