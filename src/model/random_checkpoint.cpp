// The generic random-checkpoint writer: spec validation, output directory, table expansion, seeded values, encoding
// (dense / FP8 block / MXFP4), sharding and the index. Architecture specifics live in model/<arch>_random.cpp.
#include "model/random_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <fstream>
#include <numbers>
#include <random>
#include <regex>

#include "core/error.h"
#include "core/log.h"
#include "formats/safetensors.h"

namespace bg {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kIndexName = "model.safetensors.index.json";

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// One table entry expanded for a layer/expert, with its storage plan.
struct PlannedTensor {
  const TensorSpec* spec = nullptr;
  std::string name;  // kLinear: the prefix ("model.layers.0.self_attn.q_a_proj"); kTensor: the tensor name
  Shape shape;
  TensorPlan plan;
  uint64_t nbytes = 0;  // bytes of every stored tensor of this entry (weight + scales)
  int64_t shard = 0;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint64_t planned_bytes(const PlannedTensor& t) {
  const int64_t numel = shape_numel(t.shape);
  switch (t.plan.format) {
    case WeightFormat::kDense: return static_cast<uint64_t>(numel) * dtype_size_bytes(t.plan.dtype);
    case WeightFormat::kFp8Block:
      return static_cast<uint64_t>(numel) +
             4 * static_cast<uint64_t>(ceil_div(t.shape[0], kFp8BlockSize) * ceil_div(t.shape[1], kFp8BlockSize));
    case WeightFormat::kMxfp4: return static_cast<uint64_t>(numel / 2 + numel / kMxfp4GroupSize);
  }
  return 0;
}

void check_plan(const PlannedTensor& t, const std::string& arch) {
  const TensorPlan& p = t.plan;
  BG_CHECK(p.std >= 0.0 && std::isfinite(p.std) && std::isfinite(p.mean), "{} policy: tensor '{}' has init mean {} "
           "std {}", arch, t.name, p.mean, p.std);
  if (p.format == WeightFormat::kDense) {
    BG_CHECK(p.dtype == DType::kF32 || p.dtype == DType::kBF16, "{} policy: tensor '{}' dtype {} (make-random writes "
             "F32 or BF16 dense tensors)", arch, t.name, dtype_name(p.dtype));
    return;
  }
  BG_CHECK(t.spec->kind == TensorKind::kLinear && t.shape.size() == 2, "{} policy: '{}' is not a 2-D linear, so it "
           "cannot be stored as {}", arch, t.name, weight_format_name(p.format));
  if (p.format == WeightFormat::kMxfp4) {
    BG_CHECK(t.shape[1] % kMxfp4GroupSize == 0, "mxfp4: '{}' has input dim {}, not a multiple of {}", t.name,
             t.shape[1], kMxfp4GroupSize);
  }
}

// Every tensor of the table in table order (global, then per layer, then per expert), as the loader binds them.
std::vector<PlannedTensor> plan_tensors(const ArchTable& table, const RandomTensorPolicy& policy,
                                        RandomWeightFormat format) {
  std::vector<PlannedTensor> out;
  auto add = [&](const TensorSpec& spec, int64_t layer, int64_t expert) {
    PlannedTensor t;
    t.spec = &spec;
    t.name = expand_pattern(spec.pattern, layer, expert);
    BG_CHECK(static_cast<bool>(spec.shape), "{} table: tensor '{}' has no shape formula, so make-random cannot write "
             "it", table.arch, t.name);
    t.shape = spec.shape(layer);
    BG_CHECK(spec.kind != TensorKind::kLinear || t.shape.size() == 2, "{} table: linear '{}' has shape {}",
             table.arch, t.name, shape_str(t.shape));
    t.plan = policy(spec, t.shape, format);
    check_plan(t, table.arch);
    t.nbytes = planned_bytes(t);
    out.push_back(std::move(t));
  };
  for (const auto& spec : table.specs) {
    if (spec.scope == Scope::kGlobal) {
      add(spec, -1, -1);
      continue;
    }
    for (int64_t l = 0; l < table.n_layers; ++l) {
      if (spec.in_layer && !spec.in_layer(l)) continue;
      if (spec.scope == Scope::kLayer) {
        add(spec, l, -1);
      } else {
        for (int64_t e = 0; e < table.n_experts; ++e) add(spec, l, e);
      }
    }
  }
  return out;
}

// Contiguous split in table order with about equal bytes per shard; every shard gets at least one entry.
void assign_shards(std::vector<PlannedTensor>& tensors, int64_t n_shards) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  BG_CHECK(n_shards <= n, "cannot split {} tensors into {} shards", n, n_shards);
  uint64_t total = 0;
  for (const auto& t : tensors) total += t.nbytes;
  uint64_t cum = 0;
  int64_t shard = 0, in_shard = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t shards_after = n_shards - 1 - shard, left = n - i;
    // past this shard's share of the bytes: (shard + 1) / n_shards of the total
    const bool past_target = static_cast<double>(cum) * static_cast<double>(n_shards) >=
                             static_cast<double>(total) * static_cast<double>(shard + 1);
    if (in_shard > 0 && shards_after > 0 && (past_target || left == shards_after)) {
      ++shard;
      in_shard = 0;
    }
    tensors[static_cast<size_t>(i)].shard = shard;
    cum += tensors[static_cast<size_t>(i)].nbytes;
    ++in_shard;
  }
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Normal(mean, std) values from an mt19937_64 seeded by (seed, name). Box-Muller on 53-bit uniforms rather than
// std::normal_distribution, whose algorithm the standard leaves to each library: the bytes must not depend on it.
std::vector<float> random_values(uint64_t seed, const std::string& name, int64_t n, double mean, double std) {
  std::mt19937_64 rng(splitmix64(seed ^ splitmix64(fnv1a(name))));
  constexpr double kInv53 = 1.0 / 9007199254740992.0;  // 2^-53
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i += 2) {
    double u1 = static_cast<double>((rng() >> 11) + 1) * kInv53;  // (0, 1]
    double u2 = static_cast<double>(rng() >> 11) * kInv53;        // [0, 1)
    double r = std::sqrt(-2.0 * std::log(u1)), a = 2.0 * std::numbers::pi * u2;
    out[static_cast<size_t>(i)] = static_cast<float>(mean + std * r * std::cos(a));
    if (i + 1 < n) out[static_cast<size_t>(i + 1)] = static_cast<float>(mean + std * r * std::sin(a));
  }
  return out;
}

struct OwnedTensor {
  std::string name;
  HostTensor data;
};

HostTensor reshaped(const HostTensor& t, Shape shape) {
  HostTensor out(t.dtype(), std::move(shape));
  BG_CHECK(out.nbytes() == t.nbytes(), "internal: reshape {} -> {}", shape_str(t.shape()), shape_str(out.shape()));
  std::memcpy(out.data(), t.data(), t.nbytes());
  return out;
}

// The stored tensors of one entry, named as load_linear / the table expect them.
std::vector<OwnedTensor> encode(const PlannedTensor& t, const std::vector<float>& values) {
  const bool linear = t.spec->kind == TensorKind::kLinear;
  std::vector<std::string> names =
      linear ? linear_tensor_names(t.name, t.plan.format, t.plan.mxfp4_packed) : std::vector{t.name};
  std::vector<OwnedTensor> out;
  if (t.plan.format == WeightFormat::kDense) {
    HostTensor h(t.plan.dtype, t.shape);
    if (t.plan.dtype == DType::kF32) {
      std::memcpy(h.data(), values.data(), h.nbytes());
    } else {
      auto* dst = reinterpret_cast<uint16_t*>(h.data());
      for (size_t i = 0; i < values.size(); ++i) dst[i] = f32_to_bf16(values[i]);
    }
    out.push_back({names.at(0), std::move(h)});
  } else if (t.plan.format == WeightFormat::kFp8Block) {
    HostTensor codes, scale_inv;
    quantize_fp8_block(values.data(), t.shape[0], t.shape[1], &codes, &scale_inv);
    out.push_back({names.at(0), std::move(codes)});
    out.push_back({names.at(1), std::move(scale_inv)});
  } else {
    HostTensor codes, scales;  // codes [out, in/2]: kept (compressed-tensors) or stored as blocks [out, in/32, 16]
    quantize_mxfp4(values.data(), t.shape[0], t.shape[1], &codes, &scales);
    Shape blocks = {t.shape[0], t.shape[1] / kMxfp4GroupSize, kMxfp4GroupSize / 2};
    out.push_back({names.at(0), t.plan.mxfp4_packed ? std::move(codes) : reshaped(codes, blocks)});
    out.push_back({names.at(1), std::move(scales)});
  }
  return out;
}

std::string shard_file_name(int64_t k, int64_t n) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  BG_CHECK(out.good(), "cannot create '{}'", path.string());
  out << text;
  out.close();
  BG_CHECK(out.good(), "write to '{}' failed", path.string());
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

void write_random_tensors(const ArchTable& table, const RandomTensorPolicy& policy, const RandomTensorOptions& options,
                          const fs::path& dir) {
  BG_CHECK(options.n_shards >= 1 && options.n_shards <= 99999, "make-random: shard count {} must be in [1, 99999]",
           options.n_shards);
  std::vector<PlannedTensor> tensors = plan_tensors(table, policy, options.format);
  assign_shards(tensors, options.n_shards);
  json weight_map = json::object();
  uint64_t total_bytes = 0;
  size_t next = 0;
  for (int64_t k = 0; k < options.n_shards; ++k) {
    // Only one shard's tensors are in memory at a time.
    std::vector<OwnedTensor> owned;
    for (; next < tensors.size() && tensors[next].shard == k; ++next) {
      const PlannedTensor& t = tensors[next];
      auto values = random_values(options.seed, t.name, shape_numel(t.shape), t.plan.mean, t.plan.std);
      if (t.plan.adjust) {
        t.plan.adjust(values);
        BG_CHECK(values.size() == static_cast<size_t>(shape_numel(t.shape)), "internal: adjust changed the size of "
                 "'{}'", t.name);
      }
      uint64_t bytes = 0;
      for (auto& o : encode(t, values)) {
        bytes += o.data.nbytes();
        owned.push_back(std::move(o));
      }
      BG_CHECK(bytes == t.nbytes, "internal: '{}' encoded to {} bytes, planned {}", t.name, bytes, t.nbytes);
      total_bytes += bytes;
    }
    std::string file = shard_file_name(k, options.n_shards);
    std::vector<NamedTensor> named;
    for (const auto& o : owned) {
      named.push_back({o.name, o.data.view(o.name)});
      weight_map[o.name] = file;
    }
    write_safetensors(dir / file, named, {{"format", "pt"}});
  }
  json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  write_text(dir / kIndexName, index.dump(2) + "\n");
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
  write_text(spec.out_dir / "config.json", config.dump(2) + "\n");
  if (arch.generation_config) {
    write_text(spec.out_dir / "generation_config.json", arch.generation_config(config).dump(2) + "\n");
  }
  write_random_tensors(table, policy, {format, spec.seed, spec.n_shards}, spec.out_dir);
  log::info("make-random: wrote {} {} checkpoint (preset {}, seed {}) to {}", spec.arch,
            random_weight_format_name(format), spec.preset, spec.seed, spec.out_dir.string());
}

}  // namespace bg
