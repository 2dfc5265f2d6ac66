// make-random table expansion: which tensors a checkpoint holds, how each is stored, and how they split into shards.
#include "model/random_tensor_plan.h"

#include <cmath>
#include <fmt/format.h>
#include <fstream>

#include "core/error.h"

namespace bg {
namespace {

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

}  // namespace

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
std::vector<StoredPart> stored_parts(const PlannedTensor& t) {
  const bool linear = t.spec->kind == TensorKind::kLinear;
  std::vector<std::string> names =
      linear ? linear_tensor_names(t.name, t.plan.format, t.plan.mxfp4_packed) : std::vector{t.name};
  const int64_t numel = shape_numel(t.shape);
  switch (t.plan.format) {
    case WeightFormat::kDense:
      return {{names.at(0), t.plan.dtype, t.shape, static_cast<uint64_t>(numel) * dtype_size_bytes(t.plan.dtype)}};
    case WeightFormat::kFp8Block: {
      const Shape scales = {ceil_div(t.shape[0], kFp8BlockSize), ceil_div(t.shape[1], kFp8BlockSize)};
      return {{names.at(0), DType::kF8E4M3, t.shape, static_cast<uint64_t>(numel)},
              {names.at(1), DType::kF32, scales, 4 * static_cast<uint64_t>(shape_numel(scales))}};
    }
    case WeightFormat::kMxfp4: {
      const int64_t out = t.shape[0], in = t.shape[1];
      const Shape codes = t.plan.mxfp4_packed ? Shape{out, in / 2}
                                              : Shape{out, in / kMxfp4GroupSize, kMxfp4GroupSize / 2};
      return {{names.at(0), DType::kU8, codes, static_cast<uint64_t>(numel / 2)},
              {names.at(1), DType::kU8, {out, in / kMxfp4GroupSize}, static_cast<uint64_t>(numel / kMxfp4GroupSize)}};
    }
  }
  fail("internal: unknown weight format of '{}'", t.name);
}

std::string shard_file_name(int64_t k, int64_t n) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
}

void write_text_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  BG_CHECK(out.good(), "cannot create '{}'", path.string());
  out << text;
  out.close();
  BG_CHECK(out.good(), "write to '{}' failed", path.string());
}

}  // namespace bg
