// convert_checkpoint: plan the output tensors, lay them out (safetensors shards or the store layout), fill the mapped
// output in parallel (copies, or MXFP4 quantization straight into place), checksum, write the index / manifest.
#include "weights/convert.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "formats/checkpoint.h"
#include "formats/quant.h"
#include "weights/checksum.h"
#include "weights/expert_pack.h"
#include "weights/placement.h"
#include "weights/progress.h"
#include "weights/store_builder.h"
#include "weights/store_source.h"

namespace bg::weights {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct OutTensor {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  uint64_t bytes = 0;
  uint32_t shard = 0;
  std::optional<TensorView> copy_from;  // a copied tensor
  int64_t linear = -1;                  // else: part `part` (0 codes, 1 scales) of converted linear `linear`
  int part = 0;
  std::byte* dst = nullptr;
};

struct ConvLinear {
  QuantWeight w;
  size_t out_codes = 0, out_scales = 0;  // indices into the output tensors
  double rel_err = 0.0;
};

struct Plan {
  std::vector<std::string> shards;
  std::vector<OutTensor> out;
  std::vector<ConvLinear> linears;
};

// The shard a tensor came from (a safetensors output keeps the input's sharding).
std::string shard_of(const WeightSource& src, const std::string& name) {
  if (const auto* s = dynamic_cast<const StoreSource*>(&src)) {
    const Manifest& m = s->manifest();
    const std::string& n = m.sources[m.tensors[m.by_name.at(name)].source];
    return n.rfind("peer:", 0) == 0 ? std::string("model.safetensors") : n;
  }
  return src.file_of(name);
}

Plan make_plan(const WeightSource& src, const Placement& placement, bool experts_mxfp4) {
  Plan p;
  std::map<std::string, uint32_t> shard_index;
  auto shard = [&](const std::string& name) {
    const std::string s = shard_of(src, name);
    auto [it, inserted] = shard_index.emplace(s, static_cast<uint32_t>(p.shards.size()));
    if (inserted) p.shards.push_back(s);
    return it->second;
  };
  std::vector<std::string> names = src.names();
  std::sort(names.begin(), names.end());
  std::map<std::string, bool> converted;  // expert linear prefix -> converted
  for (const std::string& name : names) {
    std::string prefix;
    const int part = linear_part(name, &prefix);
    const bool expert = part >= 0 && placement.classify(name).kind == GroupKind::kExpert;
    const bool quantized_already = src.contains(prefix + ".weight_packed") || src.contains(prefix + ".weight_blocks");
    if (experts_mxfp4 && expert && !quantized_already) {
      if (converted.count(prefix) != 0) continue;  // the scale_inv of an FP8 weight: consumed with its weight
      converted[prefix] = true;
      const TensorView w = src.get(prefix + ".weight");
      BG_CHECK(w.rank() == 2, "tensor '{}' in {}: an expert weight must be 2-D, got {}", w.name, src.file_of(w.name),
               shape_str(w.shape));
      const int64_t n_out = w.shape[0], n_in = w.shape[1];
      BG_CHECK(n_in % kMxfp4GroupSize == 0, "tensor '{}' in {}: input dim {} is not a multiple of 32, so it cannot be "
               "MXFP4", w.name, src.file_of(w.name), n_in);
      ConvLinear cl;
      cl.w = load_linear(src, prefix, n_out, n_in);
      const uint32_t s = shard(prefix + ".weight");
      cl.out_codes = p.out.size();
      p.out.push_back({prefix + ".weight_packed", DType::kU8, {n_out, n_in / 2},
                       static_cast<uint64_t>(n_out * n_in / 2), s, std::nullopt, static_cast<int64_t>(p.linears.size()),
                       0, nullptr});
      cl.out_scales = p.out.size();
      p.out.push_back({prefix + ".weight_scale", DType::kU8, {n_out, n_in / kMxfp4GroupSize},
                       static_cast<uint64_t>(n_out * n_in / kMxfp4GroupSize), s, std::nullopt,
                       static_cast<int64_t>(p.linears.size()), 1, nullptr});
      p.linears.push_back(std::move(cl));
      continue;
    }
    const TensorView v = src.get(name);
    p.out.push_back({name, v.dtype, v.shape, v.nbytes, shard(name), v, -1, 0, nullptr});
  }
  return p;
}

// Quantizes one linear row by row straight into its two output tensors; returns ||W - Q(W)|| / ||W||.
double quantize_linear(const ConvLinear& cl, std::byte* codes, std::byte* scales) {
  const QuantWeight& w = cl.w;
  std::vector<float> row(static_cast<size_t>(w.n_in)), back(static_cast<size_t>(w.n_in));
  double err2 = 0.0, ref2 = 0.0;
  QuantWeight q{WeightFormat::kMxfp4, 1, w.n_in, {}, {}, w.name, {}};
  for (int64_t r = 0; r < w.n_out; ++r) {
    w.decode_row(r, row.data());
    auto* c = reinterpret_cast<uint8_t*>(codes) + r * (w.n_in / 2);
    auto* s = reinterpret_cast<uint8_t*>(scales) + r * (w.n_in / kMxfp4GroupSize);
    quantize_row_mxfp4_ocp(row.data(), w.n_in, c, s, w.name);
    q.data = {DType::kU8, {1, w.n_in / 2}, reinterpret_cast<const std::byte*>(c), static_cast<size_t>(w.n_in / 2), ""};
    q.scale = {DType::kU8, {1, w.n_in / kMxfp4GroupSize}, reinterpret_cast<const std::byte*>(s),
               static_cast<size_t>(w.n_in / kMxfp4GroupSize), ""};
    q.decode_row(0, back.data());
    for (int64_t i = 0; i < w.n_in; ++i) {
      const double d = static_cast<double>(row[static_cast<size_t>(i)]) - back[static_cast<size_t>(i)];
      err2 += d * d;
      ref2 += static_cast<double>(row[static_cast<size_t>(i)]) * row[static_cast<size_t>(i)];
    }
  }
  return ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
}

// Fills every output tensor (copies and quantized linears) in parallel and returns their checksums.
std::vector<uint64_t> fill(Plan& p, LoadProgress& progress) {
  struct Item {
    size_t out = 0;
    int64_t linear = -1;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < p.out.size(); ++i) {
    if (p.out[i].copy_from) items.push_back({i, -1});
  }
  for (size_t l = 0; l < p.linears.size(); ++l) items.push_back({p.linears[l].out_codes, static_cast<int64_t>(l)});
  parallel_for(static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Item& it = items[static_cast<size_t>(k)];
      if (it.linear < 0) {
        OutTensor& t = p.out[it.out];
        std::memcpy(t.dst, t.copy_from->data, t.bytes);
        progress.add(t.shard, t.bytes);
        continue;
      }
      ConvLinear& cl = p.linears[static_cast<size_t>(it.linear)];
      OutTensor& c = p.out[cl.out_codes];
      OutTensor& s = p.out[cl.out_scales];
      cl.rel_err = quantize_linear(cl, c.dst, s.dst);
      progress.add(c.shard, c.bytes + s.bytes);
    }
  });
  std::vector<uint64_t> sums(p.out.size());
  parallel_for(static_cast<int64_t>(p.out.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const OutTensor& t = p.out[static_cast<size_t>(i)];
      sums[static_cast<size_t>(i)] = xxh64({t.dst, t.bytes});
    }
  });
  return sums;
}

bool is_checkpoint_file(const fs::path& f) {
  const std::string n = f.filename().string();
  return f.extension() == ".safetensors" || n == "model.safetensors.index.json" || n == kStoreManifestFile ||
         n.rfind("store-seg-", 0) == 0 || n == "convert.json";
}

void remove_checkpoint_files(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.is_regular_file() && is_checkpoint_file(e.path())) fs::remove(e.path(), ec);
  }
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  BG_CHECK(out.good(), "write to '{}' failed", path.string());
}

// Safetensors shards: header + tensors in plan order per shard, mapped and filled in place. Returns the mappings.
std::vector<MappedSegment> layout_safetensors(Plan& p, const fs::path& out, json& weight_map) {
  std::vector<MappedSegment> files;
  for (uint32_t s = 0; s < p.shards.size(); ++s) {
    json header = json::object();
    header["__metadata__"] = {{"format", "pt"}};
    uint64_t offset = 0;
    std::vector<size_t> members;
    for (size_t i = 0; i < p.out.size(); ++i) {
      if (p.out[i].shard != s) continue;
      const OutTensor& t = p.out[i];
      header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape},
                        {"data_offsets", {offset, offset + t.bytes}}};
      weight_map[t.name] = p.shards[s];
      members.push_back(i);
      offset += t.bytes;
    }
    std::string text = header.dump();
    while (text.size() % 8 != 0) text.push_back(' ');
    const uint64_t data_start = 8 + text.size();
    files.push_back(MappedSegment::create_file(out / p.shards[s], data_start + offset));
    std::byte* base = files.back().data();
    const uint64_t len = text.size();
    for (int i = 0; i < 8; ++i) base[i] = static_cast<std::byte>((len >> (8 * i)) & 0xff);
    std::memcpy(base + 8, text.data(), text.size());
    uint64_t cursor = data_start;
    for (size_t i : members) {
      p.out[i].dst = base + cursor;
      cursor += p.out[i].bytes;
    }
  }
  return files;
}

}  // namespace

void quantize_row_mxfp4_ocp(const float* x, int64_t n, uint8_t* codes, uint8_t* scales, const std::string& what) {
  for (int64_t g = 0; g < n / kMxfp4GroupSize; ++g) {
    const float* v = x + g * kMxfp4GroupSize;
    float amax = 0.0f;
    for (int64_t j = 0; j < kMxfp4GroupSize; ++j) {
      BG_CHECK(std::isfinite(v[j]), "'{}': value {} is not finite; MXFP4 cannot represent it", what, v[j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    // X = 2^(floor(log2(amax)) - emax_elem), emax_elem = 2 for E2M1; ilogb is exact where log2 may round up.
    const int e = amax > 0.0f ? std::clamp(std::ilogb(amax) - 2, -127, 127) : -127;
    scales[g] = static_cast<uint8_t>(e + 127);
    for (int64_t j = 0; j < kMxfp4GroupSize; j += 2) {
      const uint8_t lo = f32_to_e2m1(std::ldexp(v[j], -e)), hi = f32_to_e2m1(std::ldexp(v[j + 1], -e));
      codes[(g * kMxfp4GroupSize + j) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

ConvertReport convert_checkpoint(const ConvertOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  std::error_code ec;
  BG_CHECK(fs::is_directory(o.in, ec), "convert: --model {} is not a directory", o.in.string());
  fs::create_directories(o.out, ec);
  BG_CHECK(fs::is_directory(o.out, ec), "convert: cannot create --out {}", o.out.string());
  BG_CHECK(!fs::equivalent(o.in, o.out, ec), "convert: --out must differ from --model");
  BG_CHECK(!o.w4a16_experts || o.store_layout, "convert: --expert-layout w4a16 needs --layout store (safetensors "
           "holds experts as checkpoint tensors)");
  BG_CHECK(o.force || fs::is_empty(o.out, ec), "convert: --out {} is not empty (--force replaces its checkpoint files)",
           o.out.string());
  std::shared_ptr<const WeightSource> src;
  if (is_store_dir(o.in)) {
    src = StoreSource::open_dir(o.in);
  } else {
    src = Checkpoint::open(o.in);
  }
  const Placement placement = Placement::for_model(o.in);
  Plan p = make_plan(*src, placement, o.experts_mxfp4);
  remove_checkpoint_files(o.out);
  ConvertReport rep;
  try {
    for (const auto& e : fs::directory_iterator(o.in)) {
      if (e.is_regular_file() && !is_checkpoint_file(e.path())) {
        fs::copy_file(e.path(), o.out / e.path().filename(), fs::copy_options::overwrite_existing);
      }
    }
    json weight_map = json::object();
    std::vector<MappedSegment> mapped;
    std::optional<Manifest> manifest;
    if (o.store_layout) {
      std::vector<PlannedTensor> planned;
      for (const OutTensor& t : p.out) planned.push_back({t.name, t.dtype, t.shape, t.bytes, t.shard, placement.classify(t.name)});
      manifest = plan_layout(std::move(planned), p.shards, {o.segment_max_bytes, 1, o.w4a16_experts},
                             {placement.arch(), placement.config_xxh64(), new_generation()});
      mapped = StoreTarget::dir(o.out).create(*manifest);
      for (OutTensor& t : p.out) {
        const TensorInfo& ti = manifest->tensors[manifest->by_name.at(t.name)];
        t.dst = mapped[ti.segment].data() + ti.offset;
      }
    } else {
      mapped = layout_safetensors(p, o.out, weight_map);
    }
    std::vector<LoadProgress::File> files;
    for (const std::string& s : p.shards) files.push_back({s, 0});
    for (const OutTensor& t : p.out) files[t.shard].total_bytes += t.bytes;
    LoadProgress progress("converting " + o.in.string(), files, {.tty = o.progress_tty});
    progress.start();
    const std::vector<uint64_t> sums = fill(p, progress);
    progress.finish();
    json checksums = json::object();
    for (size_t i = 0; i < p.out.size(); ++i) {
      checksums[p.out[i].name] = fmt::format("{:016x}", sums[i]);
      if (manifest) manifest->tensors[manifest->by_name.at(p.out[i].name)].xxh64 = sums[i];
      rep.bytes_out += p.out[i].bytes;
    }
    if (manifest && o.w4a16_experts) {
      const PackReport pr = pack_expert_groups(*manifest, mapped);
      rep.w4a16_packed = pr.packed;
      rep.w4a16_kept = pr.kept;
      if (pr.kept > 0) log::warn("convert: {} MXFP4 experts kept as stored (first: {})", pr.kept, pr.first_kept);
    }
    mapped.clear();  // unmap (flushes the shared file mappings)
    if (manifest) {
      StoreTarget::dir(o.out).finish(*manifest);
    } else if (p.shards.size() > 1 || p.shards.front() != "model.safetensors") {
      json index = {{"metadata", {{"total_size", rep.bytes_out}}}, {"weight_map", weight_map}};
      write_text(o.out / "model.safetensors.index.json", index.dump(2));
    }
    rep.n_tensors = static_cast<int64_t>(p.out.size());
    rep.n_quantized = static_cast<int64_t>(p.linears.size());
    double sum = 0.0;
    for (const ConvLinear& cl : p.linears) {
      rep.max_rel_rms_error = std::max(rep.max_rel_rms_error, cl.rel_err);
      sum += cl.rel_err;
    }
    rep.mean_rel_rms_error = p.linears.empty() ? 0.0 : sum / static_cast<double>(p.linears.size());
    for (const std::string& n : src->names()) rep.bytes_in += src->get(n).nbytes;
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    json info = {{"source", fs::absolute(o.in).string()},
                 {"experts", o.experts_mxfp4 ? "mxfp4 (OCP MX v1.0, E8M0 per 32, E2M1 round-to-nearest-even)" : "kept"},
                 {"layout", o.store_layout ? fmt::format("store v{}", kStoreLayoutVersion) : "safetensors"},
                 {"expert_layout", o.w4a16_experts ? "w4a16" : "checkpoint"},
                 {"w4a16_blocks", rep.w4a16_packed},
                 {"quantized_linears", rep.n_quantized},
                 {"max_rel_rms_error", rep.max_rel_rms_error},
                 {"mean_rel_rms_error", rep.mean_rel_rms_error},
                 {"xxh64", checksums}};
    write_text(o.out / "convert.json", info.dump(2));
  } catch (...) {
    remove_checkpoint_files(o.out);
    throw;
  }
  return rep;
}

}  // namespace bg::weights
