// Residency planning, routing traces and the streamed-expert pool.
#include "moe/expert_stream.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/env.h"
#include "core/error.h"
#include "formats/json_fields.h"

namespace bg::moe {
namespace {

constexpr std::string_view kTraceFormat = "batchgen-expert-trace";

// [n_experts] 1 for the n_keep local experts with the highest counts (ties: lower id first), 1 for other ranks'.
std::vector<uint8_t> choose(const ExpertPlacement& placement, int64_t n_keep, const std::vector<uint64_t>* counts) {
  std::vector<int32_t> local = placement.experts_of(placement.rank());
  std::stable_sort(local.begin(), local.end(), [&](int32_t a, int32_t b) {
    return counts != nullptr && (*counts)[static_cast<size_t>(a)] > (*counts)[static_cast<size_t>(b)];
  });
  std::vector<uint8_t> keep(static_cast<size_t>(placement.n_experts()), 1);
  for (size_t i = static_cast<size_t>(n_keep); i < local.size(); ++i) keep[static_cast<size_t>(local[i])] = 0;
  return keep;
}

}  // namespace

std::vector<HostRegion> page_aligned_regions(std::vector<HostRegion> ranges) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const HostRegion& r : ranges) {
    if (r.bytes == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(r.data) / page * page;
    const auto end = (reinterpret_cast<uintptr_t>(r.data) + r.bytes + page - 1) / page * page;
    spans.emplace_back(begin, end);
  }
  std::sort(spans.begin(), spans.end());
  std::vector<HostRegion> out;
  uintptr_t begin = 0, end = 0;
  for (const auto& [b, e] : spans) {
    if (end != 0 && b <= end) {
      end = std::max(end, e);
      continue;
    }
    if (end != 0) out.push_back({reinterpret_cast<const std::byte*>(begin), end - begin});
    begin = b;
    end = e;
  }
  if (end != 0) out.push_back({reinterpret_cast<const std::byte*>(begin), end - begin});
  return out;
}

ExpertResidency ExpertResidency::plan(const ExpertPlacement& placement, double fraction,
                                      const std::filesystem::path& trace) {
  BG_CHECK(std::isfinite(fraction) && fraction >= 0.0 && fraction <= 1.0,
           "--resident-experts must be a fraction in [0, 1], got {}", fraction);
  ExpertResidency r;
  r.fraction_ = fraction;
  r.n_local_ = placement.n_local();
  r.n_resident_ = std::clamp<int64_t>(std::llround(fraction * static_cast<double>(r.n_local_)), 0, r.n_local_);
  if (r.n_resident_ == r.n_local_) r.fraction_ = 1.0;  // rounds to all: nothing streams
  r.default_ = choose(placement, r.n_resident_, nullptr);
  if (!trace.empty()) {
    for (const auto& [layer, counts] : read_expert_trace(trace, placement.n_experts())) {
      r.layer_[layer] = choose(placement, r.n_resident_, &counts);
    }
  }
  return r;
}

bool ExpertResidency::resident(int64_t layer, int64_t expert) const {
  if (!streaming()) return true;
  auto it = layer_.find(layer);
  const std::vector<uint8_t>& keep = it != layer_.end() ? it->second : default_;
  BG_CHECK(expert >= 0 && expert < static_cast<int64_t>(keep.size()), "internal: expert {} of {}", expert,
           keep.size());
  return keep[static_cast<size_t>(expert)] != 0;
}

std::vector<std::string> residency_flags(double resident_experts, const std::string& expert_trace) {
  std::vector<std::string> out;
  if (resident_experts < 1.0) out.insert(out.end(), {"--resident-experts", fmt::format("{}", resident_experts)});
  if (!expert_trace.empty()) out.insert(out.end(), {"--expert-trace", expert_trace});
  return out;
}

std::map<int64_t, std::vector<uint64_t>> read_expert_trace(const std::filesystem::path& path, int64_t n_experts) {
  const nlohmann::json doc = read_json_file(path);
  const std::string where = path.string();
  BG_CHECK(doc.is_object(), "{}: an expert trace must be a JSON object", where);
  JsonFields f(doc, where);
  BG_CHECK(f.get_string("format") == kTraceFormat, "{}: \"format\" must be \"{}\"", where, kTraceFormat);
  BG_CHECK(f.get_int("version") == 1, "{}: version {} is not supported (this build reads version 1)", where,
           f.get_int("version"));
  BG_CHECK(f.get_int("n_experts") == n_experts, "{}: a trace of {} experts for a model with {}", where,
           f.get_int("n_experts"), n_experts);
  BG_CHECK(f.has("layers") && doc["layers"].is_array(), "{}: \"layers\" must be an array", where);
  const nlohmann::json& layers = doc["layers"];
  std::map<int64_t, std::vector<uint64_t>> out;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string at = fmt::format("{} layers[{}]", where, i);
    BG_CHECK(layers[i].is_object(), "{}: must be an object", at);
    JsonFields l(layers[i], at);
    const int64_t layer = l.get_int("layer");
    BG_CHECK(layer >= 0 && !out.contains(layer), "{}: layer {} is negative or repeated", at, layer);
    BG_CHECK(l.has("counts") && layers[i]["counts"].is_array() &&
                 static_cast<int64_t>(layers[i]["counts"].size()) == n_experts,
             "{}: \"counts\" must be an array of {} integers", at, n_experts);
    const nlohmann::json& counts = layers[i]["counts"];
    std::vector<uint64_t> c;
    for (const nlohmann::json& v : counts) {
      BG_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0),
               "{}: \"counts\" must hold non-negative integers", at);
      c.push_back(v.get<uint64_t>());
    }
    out[layer] = std::move(c);
  }
  return out;
}

void write_expert_trace(const std::filesystem::path& path, int64_t n_experts,
                        const std::map<int64_t, std::vector<uint64_t>>& counts) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& [layer, c] : counts) layers.push_back({{"layer", layer}, {"counts", c}});
  const nlohmann::json doc = {{"format", kTraceFormat}, {"version", 1}, {"n_experts", n_experts}, {"layers", layers}};
  std::ofstream out(path);
  BG_CHECK(out.good(), "{}: cannot write the expert trace", path.string());
  out << doc.dump() << "\n";
  BG_CHECK(out.good(), "{}: cannot write the expert trace", path.string());
}

ExpertStream::ExpertStream(Backend& be, int64_t n_buffers, const ExpertSource& like, int64_t n_experts,
                           bool prefetch)
    : n_experts_(n_experts), prefetch_(prefetch) {
  if (!env_switch("BG_EXPERT_PREFETCH", true)) prefetch_ = false;
  BG_CHECK(n_buffers >= 1, "internal: an expert pool of {} buffers", n_buffers);
  buffers_.resize(static_cast<size_t>(n_buffers));
  for (Buffer& b : buffers_) {
    b.gate = be.alloc_linear(like.gate);
    b.up = be.alloc_linear(like.up);
    b.down = be.alloc_linear(like.down);
  }
}

ExpertHandles ExpertStream::placeholder() const {
  const Buffer& b = buffers_.front();
  return {b.gate.handle.get(), b.up.handle.get(), b.down.handle.get()};
}

void ExpertStream::fill(Buffer& b, const ExpertSource& src, std::vector<HostCopy>& copies) {
  const std::span<const std::byte> block = src.gate.w4a16.block;
  if (takes_blocks_ && src.gate.deferred() && block.size() == layout_bytes_) {
    // A weight store's W4A16 block is the layer's layout as it is: one copy into the laid-out part, nothing to lay out.
    copies.push_back({b.laid_out, 0, const_cast<std::byte*>(block.data()), block.size()});
    stats_.bytes_copied += block.size();
    b.needs_layout = false;
    ++stats_.copies;
    return;
  }
  b.needs_layout = layout_bytes_ > 0;
  auto add = [&](const WritableLinear& dst, const QuantWeight& deferred_or_not) {
    const QuantWeight w = deferred_or_not.resolved();  // a deferred expert's checkpoint bytes (unpacked once)
    BG_CHECK(w.format == dst.format && w.n_out == dst.n_out && w.n_in == dst.n_in &&
                 w.data.nbytes == dst.data.nbytes() && w.scale.nbytes == (dst.scale.empty() ? 0 : dst.scale.nbytes()),
             "streamed expert {}: [{}, {}] {} of {} + {} bytes does not fit the pool's [{}, {}] {} buffers", w.name,
             w.n_out, w.n_in, weight_format_name(w.format), w.data.nbytes, w.scale.nbytes, dst.n_out, dst.n_in,
             weight_format_name(dst.format));
    // copy_from_host only reads the host side (the checkpoint mapping or the weight store is read-only).
    copies.push_back({dst.data, 0, const_cast<std::byte*>(w.data.data), w.data.nbytes});
    if (w.scale.nbytes > 0) copies.push_back({dst.scale, 0, const_cast<std::byte*>(w.scale.data), w.scale.nbytes});
    stats_.bytes_copied += w.data.nbytes + w.scale.nbytes;
  };
  add(b.gate, src.gate);
  add(b.up, src.up);
  add(b.down, src.down);
  ++stats_.copies;
}

void ExpertStream::add_host_bytes(const ExpertSource& src) {
  if (src.gate.deferred()) {  // the weight store's block (its segments are pinned already)
    host_bytes_.push_back({src.gate.w4a16.block.data(), src.gate.w4a16.block.size()});
    return;
  }
  for (const QuantWeight* w : {&src.gate, &src.up, &src.down}) {
    host_bytes_.push_back({w->data.data, w->data.nbytes});
    if (w->scale.nbytes > 0) host_bytes_.push_back({w->scale.data, w->scale.nbytes});
  }
}

void ExpertStream::pin_host_bytes(Backend& be) {
  BG_CHECK(!pinned_, "internal: the expert pool's host bytes are pinned twice");
  const std::vector<HostRegion> regions = page_aligned_regions(std::move(host_bytes_));
  host_bytes_ = {};
  pinned_ = be.pin_host_memory(regions);
}

void ExpertStream::adopt_layout(Backend& be, const ExpertSlots& slots) {
  const size_t bytes = be.expert_layout_bytes(slots);
  if (layout_adopted_) {
    BG_CHECK(bytes == layout_bytes_, "streamed experts: a layer laid out in {} bytes per expert, another in {} (every "
             "MoE layer's experts must be alike)", bytes, layout_bytes_);
    takes_blocks_ = takes_blocks_ && be.expert_layout_takes_blocks(slots);
    return;
  }
  layout_adopted_ = true;
  layout_bytes_ = bytes;
  takes_blocks_ = bytes > 0 && be.expert_layout_takes_blocks(slots);
  if (bytes == 0) return;
  for (Buffer& b : buffers_) b.laid_out = be.alloc({static_cast<int64_t>(bytes)}, DType::kU8);
}

void ExpertStream::stage(Backend& be, int64_t layer, ExpertTable& table, std::span<const int32_t> rows_per_slot) {
  ++epoch_;
  if (last_layer_ >= 0) next_of_[last_layer_] = layer;  // the order the model stages its layers in
  last_layer_ = layer;
  if (sources_.count(layer) == 0) sources_[layer] = table.streamed_sources();  // for prefetches into this layer
  slots_[layer] = &table.slots();
  std::vector<uint64_t>& counts = counts_[layer];
  counts.resize(static_cast<size_t>(n_experts_), 0);
  std::vector<int64_t> missing;  // slots whose streamed expert is in no buffer
  std::vector<int32_t>& routed = last_routed_[layer];
  routed.clear();
  CopyFence prefetched = 0;      // the latest prefetch a hit below must wait for
  for (int64_t s = 0; s < table.n_slots(); ++s) {
    const int32_t rows = rows_per_slot[static_cast<size_t>(s)];
    if (rows <= 0) continue;
    const int32_t e = table.expert_in(s);
    counts[static_cast<size_t>(e)] += static_cast<uint64_t>(rows);
    if (table.source(e) == nullptr) continue;  // resident
    routed.push_back(e);
    auto it = where_.find({layer, e});
    if (it == where_.end()) {
      missing.push_back(s);
      continue;
    }
    Buffer& b = buffers_[it->second];
    b.last_use = epoch_;  // kept for this layer: not a victim below
    ++stats_.hits;
    if (b.pending != 0) {
      ++stats_.prefetch_hits;
      prefetched = std::max(prefetched, b.pending);
      b.pending = 0;
    }
    point(be, table, layer, s, it->second);
  }
  std::vector<HostCopy> copies;  // every missing expert's bytes in one batch on the copy stream
  for (int64_t s : missing) {
    const size_t victim = pick_victim();
    BG_CHECK(victim < buffers_.size(), "internal: the expert pool of {} buffers cannot hold layer {}'s streamed "
             "experts", buffers_.size(), layer);
    load(buffers_[victim], victim, layer, table.expert_in(s), *table.source(table.expert_in(s)), copies);
    point(be, table, layer, s, victim);
  }
  if (prefetched != 0) be.compute_wait(prefetched);  // prefetched experts: their copies land before they run
  if (!copies.empty()) be.compute_wait(be.copy_from_host(copies));  // the layer's experts run after the copies land
  if (layout_bytes_ > 0) {  // the buffers this layer uses that were loaded since last laid out, after their copies
    for (int64_t s = 0; s < table.n_slots(); ++s) {
      if (rows_per_slot[static_cast<size_t>(s)] <= 0) continue;
      const int32_t e = table.expert_in(s);
      if (table.source(e) == nullptr) continue;
      Buffer& b = buffers_[where_.at({layer, e})];
      if (!b.needs_layout) continue;
      be.lay_out_expert(table.slots(), *b.gate.handle, *b.up.handle, *b.down.handle, b.laid_out);
      b.needs_layout = false;
    }
  }
  if (prefetch_) prefetch(be);
}

size_t ExpertStream::pick_victim() const {
  size_t victim = buffers_.size();
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].last_use == epoch_) continue;
    if (victim == buffers_.size() || buffers_[b].last_use < buffers_[victim].last_use) victim = b;
  }
  return victim;
}

void ExpertStream::load(Buffer& b, size_t index, int64_t layer, int32_t expert, const ExpertSource& src,
                        std::vector<HostCopy>& copies) {
  if (b.expert >= 0) where_.erase({b.layer, b.expert});
  fill(b, src, copies);  // sets needs_layout
  b.layer = layer;
  b.expert = expert;
  b.last_use = epoch_;
  b.pending = 0;
  where_[{layer, expert}] = index;
}

void ExpertStream::point(Backend& be, ExpertTable& table, int64_t layer, int64_t slot, size_t index) {
  size_t& at = pointed_[{layer, slot}];
  if (at == index + 1) return;  // already there (0: never pointed by the pool)
  const Buffer& b = buffers_[index];
  table.point(be, slot, {b.gate.handle.get(), b.up.handle.get(), b.down.handle.get()},
              layout_bytes_ > 0 ? &b.laid_out : nullptr);
  at = index + 1;
}

// The next layer's streamed experts that its last stage routed rows to, copied now into buffers this layer does not
// use, so that the copies run while this layer and the attention before the next one compute. The copies are ordered
// after every op issued so far (nothing running reads those buffers); the next layer waits for them only if it uses
// them. A wrong guess costs copy bandwidth, never a wrong result.
void ExpertStream::prefetch(Backend& be) {
  const auto next = next_of_.find(last_layer_);
  if (next == next_of_.end()) return;
  const auto routed = last_routed_.find(next->second);
  const auto sources = sources_.find(next->second);
  if (routed == last_routed_.end() || sources == sources_.end()) return;
  std::vector<HostCopy> copies;
  std::vector<size_t> filled;
  for (int32_t e : routed->second) {
    if (where_.count({next->second, e}) != 0) continue;
    const size_t victim = pick_victim();
    if (victim == buffers_.size()) break;  // every buffer is this layer's or already prefetched
    load(buffers_[victim], victim, next->second, e, sources->second.at(e), copies);  // last_use = epoch_: kept
    filled.push_back(victim);
    ++stats_.prefetches;
  }
  if (copies.empty()) return;
  CopyFence fence = be.prefetch_from_host(copies);
  if (layout_bytes_ > 0) {  // laid out right after their copies, off the compute stream too
    for (size_t b : filled) {
      Buffer& buf = buffers_[b];
      if (!buf.needs_layout) continue;  // copied as a W4A16 block
      fence = be.lay_out_expert_ahead(*slots_.at(next->second), *buf.gate.handle, *buf.up.handle, *buf.down.handle,
                                      buf.laid_out);
      buf.needs_layout = false;
    }
  }
  for (size_t b : filled) buffers_[b].pending = fence;
}

}  // namespace bg::moe
