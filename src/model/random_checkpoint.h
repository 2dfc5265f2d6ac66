// Random-weight checkpoints in the published layout (config.json, `model-0000k-of-0000n.safetensors` shards and
// `model.safetensors.index.json`). Every tensor is enumerated from the architecture's ArchTable, so the writer and
// the loader cannot disagree; an architecture plugs in with a RandomArch (presets, config builder, table, policy).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "formats/quant.h"
#include "model/arch_table.h"

namespace bg {

// How the weights of a whole checkpoint are stored (each arch's policy maps it to per-tensor formats).
enum class RandomWeightFormat : uint8_t {
  kF32,    // everything F32
  kBF16,   // everything BF16 (the arch may keep a few tensors, e.g. router biases, in F32)
  kFp8,    // DeepSeek FP8: 2-D linears F8_E4M3 + 128x128 weight_scale_inv; the rest BF16
  kMxfp4,  // routed experts MXFP4 (gpt-oss .weight_blocks/.weight_scales or compressed-tensors .weight_packed/
           // .weight_scale, as the arch's policy says); the rest BF16
};

// "f32" | "bf16" | "fp8" | "mxfp4"; anything else is a bg::Error listing the choices.
RandomWeightFormat parse_random_weight_format(const std::string& name);
std::string_view random_weight_format_name(RandomWeightFormat format);

// A routed expert: layer index (0-based, as in tensor names) and expert index.
struct ExpertRef {
  int64_t layer = 0;
  int64_t expert = 0;
};

struct RandomCheckpointSpec {
  std::string arch = "deepseek_v3";
  std::string preset = "tiny";
  std::string format;  // "" = the arch's default format (deepseek_v3: bf16, kimi_k3: mxfp4)
  uint64_t seed = 0;
  std::filesystem::path out_dir;
  int64_t n_shards = 2;
  // Write into a non-empty out_dir: the checkpoint files there (config.json, model*.safetensors, the index) are
  // replaced; other files are left alone.
  bool force = false;
  // Generation threads: 0 = the process-wide pool (BG_NUM_THREADS or all cores). The bytes never depend on it.
  int n_threads = 0;
  // Progress on stderr while writing (bytes, GB/s): a live line on a terminal, a log line every few seconds otherwise.
  bool show_progress = false;
  // Elements drawn and encoded per unit of work (0: 4 Mi). The bytes never depend on it; tests make it small so that
  // every tensor is split into many row pieces.
  int64_t piece_elements = 0;
  // Applied on top of the preset's config.json before the tensors are enumerated. An object merges key by key (nested
  // objects merge, any other value, null included, replaces); an array is an RFC 6902 JSON Patch
  // ([{"op":"replace","path":"/rope_parameters","value":{...}}, {"op":"remove","path":"/n_group"}]) for replacing
  // whole objects or removing keys. Derived fields (e.g. DeepSeek's head_dim) are recomputed afterwards.
  nlohmann::json config_patch = nlohmann::json::object();
  // Experts whose down projection is overwritten with NaN after writing (fault-containment tests; MXFP4 experts get
  // NaN E8M0 scales, which the GPU's W4A16 layout refuses at load; use a float format to test requests at run time).
  std::vector<ExpertRef> poison_experts;
};

// Validates the spec, then writes config.json, the shards and the index. Throws bg::Error.
void write_random_checkpoint(const RandomCheckpointSpec& spec);

// Overwrites the down projection of one routed expert of a written checkpoint with NaN (see poison_experts). Throws
// bg::Error when the layer has no such expert.
void poison_random_expert(const std::filesystem::path& dir, const ExpertRef& target);

// The config.json write_random_checkpoint would write for `spec` (preset + patch + derived fields + the format's
// quantization_config), without touching the disk.
nlohmann::json random_checkpoint_config(const RandomCheckpointSpec& spec);

// The bytes of every tensor write_random_checkpoint would write (= the index's metadata.total_size), computed from
// the table without drawing or writing anything (for real-dimension presets).
uint64_t random_checkpoint_total_bytes(const RandomCheckpointSpec& spec);

// Recursive merge: objects merge key by key; any other patch value (null included) replaces the target's.
void apply_config_patch(nlohmann::json& target, const nlohmann::json& patch);

// ---- What an architecture provides --------------------------------------------------------------------------

// How one table entry is stored and initialised: fp32 values ~ Normal(mean, std), then encoded in `format`/`dtype`.
struct TensorPlan {
  WeightFormat format = WeightFormat::kDense;  // kLinear entries: dense, FP8 block or MXFP4 (kTensor: dense only)
  DType dtype = DType::kBF16;                  // storage dtype of dense tensors
  double mean = 0.0;
  double std = 0.02;
  bool mxfp4_packed = false;  // kMxfp4: compressed-tensors .weight_packed [out, in/2] + .weight_scale [out, in/32]
  // Optional: edits drawn fp32 values (row-dependent scales, zero padding) before encoding. Called on pieces of the
  // tensor (row ranges, in any order and from any thread): `values` holds the row-major elements
  // [first, first + values.size()) of the whole tensor, so a rule must depend only on the element index.
  std::function<void(std::span<float> values, int64_t first)> adjust;
};

// shape: the expanded shape ({out, in} for linears).
using RandomTensorPolicy =
    std::function<TensorPlan(const TensorSpec& spec, const Shape& shape, RandomWeightFormat format)>;

struct RandomArch {
  std::string name;                  // the --arch value, e.g. "deepseek_v3"
  std::vector<std::string> presets;  // --preset values, smallest first
  // The complete config.json of a preset (format independent); called only with a name from `presets`.
  std::function<nlohmann::json(const std::string& preset)> preset_config;
  // After the patch: recompute derived fields and add the format's quantization_config.
  std::function<void(nlohmann::json& config, RandomWeightFormat format)> finalize_config;
  // The tensor table of a (final) config; `where` names the config in errors.
  std::function<ArchTable(const nlohmann::json& config, const std::string& where)> table;
  RandomTensorPolicy policy;
  // Optional: a policy that depends on the final config (e.g. which rows of a fused projection are which); replaces
  // `policy` when set.
  std::function<RandomTensorPolicy(const nlohmann::json& config, const std::string& where)> config_policy;
  // Optional: generation_config.json of a final config.
  std::function<nlohmann::json(const nlohmann::json& config)> generation_config;
  // The --format values it supports; the first is the default.
  std::vector<RandomWeightFormat> formats = {RandomWeightFormat::kBF16, RandomWeightFormat::kF32,
                                             RandomWeightFormat::kFp8, RandomWeightFormat::kMxfp4};
};

// The architectures make-random can write. Adding one = a table + a RandomArch (presets, config builder, policy).
const std::vector<RandomArch>& random_archs();
// Throws a bg::Error naming the supported architectures.
const RandomArch& find_random_arch(const std::string& name);

// DeepSeek-V3 (model/deepseek_v3_random.cpp).
RandomArch deepseek_v3_random_arch();
// Kimi-K3 (model/kimi_k3_random.cpp).
RandomArch kimi_k3_random_arch();

struct RandomTensorOptions {
  RandomWeightFormat format = RandomWeightFormat::kBF16;
  uint64_t seed = 0;
  int64_t n_shards = 2;
  int n_threads = 0;           // 0: the process-wide pool
  bool show_progress = false;  // see RandomCheckpointSpec
  int64_t piece_elements = 0;  // see RandomCheckpointSpec
};

// Generic part (random_checkpoint_writer.cpp): writes every tensor of `table` as planned by `policy` into `dir`
// (which must exist) as model-0000k-of-0000n.safetensors shards plus model.safetensors.index.json. Element i of a
// tensor depends only on (seed, tensor name, i), so a tensor does not change when others are added or removed, and
// the files are the same whatever the thread count. Tensors are generated in row pieces on all threads and written
// in place (pwrite at their final offsets), so memory stays at a few pieces per thread whatever the checkpoint size.
void write_random_tensors(const ArchTable& table, const RandomTensorPolicy& policy, const RandomTensorOptions& options,
                          const std::filesystem::path& dir);

}  // namespace bg
