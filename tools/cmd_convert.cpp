// `batchgen convert`: re-pack a checkpoint (routed experts -> MXFP4, and/or the weight store's layout on disk).
#include "core/log.h"
#include "tools/commands.h"
#include "weights/convert.h"
#include "weights/progress.h"

namespace bg::tools {

void register_convert(CLI::App& app) {
  auto o = std::make_shared<weights::ConvertOptions>();
  auto experts = std::make_shared<std::string>("keep");
  auto layout = std::make_shared<std::string>("safetensors");
  auto segment_gb = std::make_shared<double>(8.0);
  auto expert_layout = std::make_shared<std::string>("checkpoint");
  auto* cmd = app.add_subcommand("convert", "Re-pack a checkpoint: experts to MXFP4, or the weight store's layout");
  cmd->add_option("--model", o->in, "Input checkpoint directory")->required();
  cmd->add_option("--out", o->out, "Output directory")->required();
  cmd->add_option("--experts", *experts, "keep (default) or mxfp4 (BF16/F16/F32/FP8 routed experts -> OCP MXFP4)")
      ->check(CLI::IsMember({"keep", "mxfp4"}));
  cmd->add_option("--layout", *layout, "safetensors (default: the input's shards) or store (weightd's layout: "
                  "loads with no re-layout)")->check(CLI::IsMember({"safetensors", "store"}));
  cmd->add_option("--segment-gb", *segment_gb, "--layout store: largest segment file in GB (default 8)")
      ->check(CLI::Range(0.001, 1024.0));
  cmd->add_option("--expert-layout", *expert_layout, "--layout store: checkpoint (default) or w4a16 (MXFP4 experts "
                  "in the GPU kernel's layout, see docs/WEIGHTS.md)")->check(CLI::IsMember({"checkpoint", "w4a16"}));
  cmd->add_flag("--force", o->force, "Replace the checkpoint files of a non-empty output directory");
  cmd->callback([o, experts, layout, segment_gb, expert_layout] {
    o->experts_mxfp4 = *experts == "mxfp4";
    o->store_layout = *layout == "store";
    o->w4a16_experts = *expert_layout == "w4a16";
    o->segment_max_bytes = static_cast<uint64_t>(*segment_gb * 1e9);
    const weights::ConvertReport r = weights::convert_checkpoint(*o);
    log::info("converted {} -> {}: {} tensors, {} -> {} in {:.2f} s", o->in.string(), o->out.string(), r.n_tensors,
              weights::format_bytes(r.bytes_in), weights::format_bytes(r.bytes_out), r.seconds);
    if (r.n_quantized > 0) {
      log::info("{} expert linears quantized to MXFP4: relative RMS error max {:.4f}, mean {:.4f} (convert.json)",
                r.n_quantized, r.max_rel_rms_error, r.mean_rel_rms_error);
    }
    if (o->w4a16_experts) {
      log::info("{} experts written as W4A16 blocks, {} kept as stored", r.w4a16_packed, r.w4a16_kept);
    }
  });
}

}  // namespace bg::tools
