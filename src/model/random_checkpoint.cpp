// make-random's front: spec validation, the preset config and its patch, the output directory, and the arch
// registry. Table expansion is model/random_tensor_plan.cpp, the tensor writer model/random_checkpoint_writer.cpp,
// architecture specifics model/<arch>_random.cpp.
#include "model/random_checkpoint.h"

#include <algorithm>
#include <regex>

#include "core/error.h"
#include "core/log.h"
#include "model/random_tensor_plan.h"

namespace bg {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

bool is_checkpoint_file(const std::string& name) {
  static const std::regex shard_re(R"(^model-\d{5}-of-\d{5}\.safetensors$)");
  return name == "config.json" || name == "generation_config.json" || name == kIndexName ||
         name == "model.safetensors" || std::regex_match(name, shard_re);
}

// Creates out_dir, or checks it is empty; with `force`, removes the checkpoint files of an earlier run.
void prepare_out_dir(const fs::path& dir, bool force) {
  if (!fs::exists(dir)) {
    fs::create_directories(dir);
    return;
  }
  BG_CHECK(fs::is_directory(dir), "output '{}' exists and is not a directory", dir.string());
  if (fs::is_empty(dir)) return;
  BG_CHECK(force, "output directory '{}' is not empty (use --force to replace the checkpoint in it)", dir.string());
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file() && is_checkpoint_file(entry.path().filename().string())) fs::remove(entry.path());
  }
}

// "" -> the arch's default; otherwise a format the arch supports.
RandomWeightFormat arch_format(const RandomArch& arch, const std::string& name) {
  if (name.empty()) return arch.formats.at(0);
  RandomWeightFormat format = parse_random_weight_format(name);
  if (std::find(arch.formats.begin(), arch.formats.end(), format) == arch.formats.end()) {
    std::vector<std::string> names;
    for (auto f : arch.formats) names.emplace_back(random_weight_format_name(f));
    fail("make-random: {} has no '{}' format (choose {})", arch.name, name, join(names));
  }
  return format;
}

RandomTensorPolicy arch_policy(const RandomArch& arch, const json& config, const std::string& where) {
  return arch.config_policy ? arch.config_policy(config, where) : arch.policy;
}

}  // namespace

RandomWeightFormat parse_random_weight_format(const std::string& name) {
  if (name == "f32") return RandomWeightFormat::kF32;
  if (name == "bf16") return RandomWeightFormat::kBF16;
  if (name == "fp8") return RandomWeightFormat::kFp8;
  if (name == "mxfp4") return RandomWeightFormat::kMxfp4;
  fail("unknown weight format '{}' (choose f32, bf16, fp8 or mxfp4)", name);
}

std::string_view random_weight_format_name(RandomWeightFormat format) {
  switch (format) {
    case RandomWeightFormat::kF32: return "f32";
    case RandomWeightFormat::kBF16: return "bf16";
    case RandomWeightFormat::kFp8: return "fp8";
    case RandomWeightFormat::kMxfp4: return "mxfp4";
  }
  return "?";
}

void apply_config_patch(json& target, const json& patch) {
  if (!patch.is_object() || !target.is_object()) {
    target = patch;
    return;
  }
  for (const auto& [key, value] : patch.items()) {
    if (value.is_object() && target.contains(key) && target[key].is_object()) {
      apply_config_patch(target[key], value);
    } else {
      target[key] = value;
    }
  }
}

const std::vector<RandomArch>& random_archs() {
  static const std::vector<RandomArch> archs = {deepseek_v3_random_arch(), kimi_k3_random_arch()};
  return archs;
}

const RandomArch& find_random_arch(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& a : random_archs()) {
    if (a.name == name) return a;
    names.push_back(a.name);
  }
  fail("make-random: unknown arch '{}' (supported: {})", name, join(names));
}

json random_checkpoint_config(const RandomCheckpointSpec& spec) {
  const RandomArch& arch = find_random_arch(spec.arch);
  RandomWeightFormat format = arch_format(arch, spec.format);
  BG_CHECK(std::find(arch.presets.begin(), arch.presets.end(), spec.preset) != arch.presets.end(),
           "make-random: unknown preset '{}' for {} (choose {})", spec.preset, arch.name, join(arch.presets));
  const json& patch = spec.config_patch;
  BG_CHECK(patch.is_object() || patch.is_array() || patch.is_null(), "make-random: the config patch must be a JSON "
           "object (merged) or a JSON Patch array, got {}", patch.dump());
  json config = arch.preset_config(spec.preset);
  if (patch.is_object()) apply_config_patch(config, patch);
  if (patch.is_array()) {
    try {
      config = config.patch(patch);
    } catch (const json::exception& e) {
      fail("make-random: JSON Patch {} does not apply to the {} config: {}", patch.dump(), spec.preset, e.what());
    }
  }
  arch.finalize_config(config, format);
  return config;
}

uint64_t random_checkpoint_total_bytes(const RandomCheckpointSpec& spec) {
  const RandomArch& arch = find_random_arch(spec.arch);
  RandomWeightFormat format = arch_format(arch, spec.format);
  json config = random_checkpoint_config(spec);
  const std::string where = "make-random " + spec.arch + " config";
  uint64_t total = 0;
  for (const auto& t : plan_tensors(arch.table(config, where), arch_policy(arch, config, where), format)) {
    total += t.nbytes;
  }
  return total;
}

void write_random_checkpoint(const RandomCheckpointSpec& spec) {
  const RandomArch& arch = find_random_arch(spec.arch);
  RandomWeightFormat format = arch_format(arch, spec.format);
  BG_CHECK(!spec.out_dir.empty(), "make-random: no output directory given");
  BG_CHECK(spec.n_shards >= 1 && spec.n_shards <= 99999, "make-random: shard count {} must be in [1, 99999]",
           spec.n_shards);
  json config = random_checkpoint_config(spec);
  // The table is built (and the config validated by the loader's parser) before anything is written.
  const std::string where = "make-random " + spec.arch + " config";
  ArchTable table = arch.table(config, where);
  RandomTensorPolicy policy = arch_policy(arch, config, where);
  plan_tensors(table, policy, format);  // policy errors (e.g. an MXFP4 dim) before anything is written
  prepare_out_dir(spec.out_dir, spec.force);
  write_text_file(spec.out_dir / "config.json", config.dump(2) + "\n");
  if (arch.generation_config) {
    write_text_file(spec.out_dir / "generation_config.json", arch.generation_config(config).dump(2) + "\n");
  }
  write_random_tensors(table, policy,
                       {format, spec.seed, spec.n_shards, spec.n_threads, spec.show_progress, spec.piece_elements},
                       spec.out_dir);
  for (const ExpertRef& e : spec.poison_experts) poison_random_expert(spec.out_dir, e);
  log::info("make-random: wrote {} {} checkpoint (preset {}, seed {}) to {}", spec.arch,
            random_weight_format_name(format), spec.preset, spec.seed, spec.out_dir.string());
}

}  // namespace bg
