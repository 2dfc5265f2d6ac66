// CUDA MoE stages over backend tensors: expert slots (descriptors + W4A16 layout) and the stage launchers.
#include "backend/cuda/cuda_moe.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <tuple>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"
#include "ops/moe_w4a16/moe_w4a16_prefill_cuda.h"

namespace bg::cuda {
namespace {

using bf16 = __nv_bfloat16;

ops::ExpertWeightsCuda descs(const LinearHandle& gate, const LinearHandle& up, const LinearHandle& down) {
  return {cuda_linear(gate).desc(), cuda_linear(up).desc(), cuda_linear(down).desc()};
}

ops::MoeWorkspace workspace(const MoeContext& c, const MoeRouting& r) {
  ops::MoeWorkspace ws;
  static_cast<ops::MoeRoutingArrays&>(ws) = ops::moe_routing_layout(r.shape, r.buffer.data);
  ws.error_flags = c.error_flags;
  return ws;
}

// BG_MOE_FFN_PATH=skinny|tiled pins the stage expert kernel, which is otherwise chosen by the routing's token count.
// Lets a test compare routings of different shapes (one rank against an ll rank set, whose receive side counts every
// source rank's tokens) with the same per-row arithmetic. Unset, empty or auto: automatic; anything else an error.
ops::MoeFfnPath ffn_path_from_env() {
  switch (env_choice("BG_MOE_FFN_PATH", {"skinny", "tiled", "auto"})) {
    case 0: return ops::MoeFfnPath::kSkinny;
    case 1: return ops::MoeFfnPath::kTiled;
    default: return ops::MoeFfnPath::kAuto;
  }
}

ops::MoeCudaParams params(const MoeRouting& r, int64_t hidden, int64_t inter) {
  ops::MoeCudaParams p;
  p.path = ffn_path_from_env();
  p.shape = r.shape;
  p.hidden = hidden;
  p.inter = inter;
  p.expert_format = WeightFormat::kDense;
  return p;
}

ops::MoeGluParams glu_params(const GluSpec& g) {
  return {g.kind == GluKind::kSwiGlu ? ops::MoeGlu::kSwiGlu : ops::MoeGlu::kSitu, g.situ_beta, g.situ_linear_beta};
}

void expect_bf16(const Tensor& t, const char* what) {
  BG_CHECK(t.device == DeviceKind::kCuda && t.dtype == DType::kBF16, "cuda backend: {} must be BF16 device memory",
           what);
}

}  // namespace

bool moe_w4a16_wanted() { return env_switch("BG_MOE_W4A16", true); }

bool store_blocks_direct_wanted() { return env_switch("BG_STORE_W4A16_DIRECT", true); }

bool moe_w4a16_device_pack_wanted() { return env_choice("BG_MOE_W4A16_PACK", {"host", "device"}) != 0; }

bool w4a16_packable(std::span<const QuantWeight* const> weights) {
  return !weights.empty() && std::all_of(weights.begin(), weights.end(), [](const QuantWeight* w) {
    return w->format == WeightFormat::kMxfp4 && w->n_in % kMxfp4GroupSize == 0 && w->n_out % kMxfp4GroupSize == 0;
  });
}

CudaExpertSlots::CudaExpertSlots(const ExpertWeights& by_slot, WeightUploader& uploader) {
  BG_CHECK(by_slot.size() > 0, "prepare_experts: no experts");
  std::vector<const QuantWeight*> all;
  for (int64_t s = 0; s < by_slot.size(); ++s) {
    auto i = static_cast<size_t>(s);
    host_.push_back(descs(*by_slot.gate[i], *by_slot.up[i], *by_slot.down[i]));
    views_.push_back({&cuda_linear(*by_slot.gate[i]).host(), &cuda_linear(*by_slot.up[i]).host(),
                      &cuda_linear(*by_slot.down[i]).host()});
    all.insert(all.end(), {views_.back().gate, views_.back().up, views_.back().down});
  }
  // MXFP4 experts the W4A16 kernel takes live in its layout only (BG_MOE_W4A16=0 at load: never).
  all.insert(all.end(), by_slot.streamed_host.begin(), by_slot.streamed_host.end());
  if (n_slots() <= 1024 && moe_w4a16_wanted() && w4a16_packable(all)) {
    pack(by_slot, uploader);
  } else {
    upload_deferred(uploader);
    log::debug("cuda moe: {} experts [{} x {}] {}: stage kernels (the W4A16 kernel takes MXFP4 experts with widths "
               "in multiples of 32)", n_slots(), gate0().n_out, gate0().n_in, weight_format_name(gate0().format));
  }
  stages_ = std::all_of(host_.begin(), host_.end(), [](const ops::ExpertWeightsCuda& e) {
    return e.gate.data != nullptr && e.up.data != nullptr && e.down.data != nullptr;
  });
  dev_ = upload(host_);
}

// The layer's W4A16 layout: the scale shifts over every expert it will hold (its streamed ones' host weights too), the
// resident slots packed now, the streamed slots' block pointers null until set points them at a laid-out pool buffer.
void CudaExpertSlots::pack(const ExpertWeights& by_slot, WeightUploader& uploader) {
  BG_CHECK(by_slot.streamed_host.size() % 3 == 0, "prepare_experts: {} streamed host weights (3 per expert)",
           by_slot.streamed_host.size());
  std::vector<ops::MoeW4a16ExpertView> known;
  std::vector<const ops::MoeW4a16ExpertView*> present(views_.size(), nullptr);
  for (size_t s = 0; s < views_.size(); ++s) {
    if (s < by_slot.streamed_slots.size() && by_slot.streamed_slots[s]) continue;
    known.push_back(views_[s]);
    present[s] = &views_[s];
  }
  for (size_t i = 0; i < by_slot.streamed_host.size(); i += 3) {
    known.push_back({by_slot.streamed_host[i], by_slot.streamed_host[i + 1], by_slot.streamed_host[i + 2]});
  }
  const ops::DeviceWeight& g = gate0();
  // A weight store's W4A16 blocks (experts bound deferred) are this layer's blocks as they are when every expert of
  // the layer is one: their scale shifts are 0 by construction. Otherwise the deferred ones are unpacked and the
  // layer packed as usual.
  const auto is_block = [&](const ops::MoeW4a16ExpertView& v) {
    return v.gate->deferred() && v.up->deferred() && v.down->deferred() &&
           v.gate->w4a16.version == ops::kMoeW4a16LayoutVersion && v.gate->w4a16.hidden == g.n_in &&
           v.gate->w4a16.inter == g.n_out && v.gate->w4a16.block.data() == v.up->w4a16.block.data() &&
           v.gate->w4a16.block.data() == v.down->w4a16.block.data();
  };
  if (store_blocks_direct_wanted() && std::all_of(known.begin(), known.end(), is_block)) {
    ops::MoeW4a16LayoutInfo info = ops::moe_w4a16_layout_info(n_slots(), g.n_in, g.n_out);
    if (std::all_of(known.begin(), known.end(), [&](const ops::MoeW4a16ExpertView& v) {
          return static_cast<int64_t>(v.gate->w4a16.block.size()) == info.block_bytes;
        })) {
      upload_blocks(info, present, uploader);
      return;
    }
  }
  for (size_t s = 0; s < views_.size(); ++s) {
    views_[s] = {resolved(views_[s].gate), resolved(views_[s].up), resolved(views_[s].down)};
  }
  for (ops::MoeW4a16ExpertView& v : known) v = {resolved(v.gate), resolved(v.up), resolved(v.down)};
  ops::MoeW4a16LayoutInfo info = ops::moe_w4a16_layer_info(known, g.n_in, g.n_out);
  info.n_slots = n_slots();
  info.total_bytes = info.n_slots * info.block_bytes;
  if (moe_w4a16_device_pack_wanted()) {
    pack_on_device(info, present, uploader);
  } else {
    w4a16_ = ops::moe_w4a16_upload_slots(info, present);
  }
}

// The present slots' checkpoint-format bytes go up through the uploader (straight from pinned memory such as a weight
// store's segments, else through its pinned staging buffers) into a temporary allocation, a chunk of experts at a
// time, and the device packs each expert from there into its block (ops::moe_w4a16_pack_cuda, the host packer's bytes
// exactly). The layer's device memory is its layout plus one chunk at the peak.
void CudaExpertSlots::pack_on_device(const ops::MoeW4a16LayoutInfo& info,
                                     std::span<const ops::MoeW4a16ExpertView* const> present,
                                     WeightUploader& uploader) {
  std::vector<bool> is_present(present.size());
  std::vector<size_t> slots;
  for (size_t s = 0; s < present.size(); ++s) {
    is_present[s] = present[s] != nullptr;
    if (is_present[s]) slots.push_back(s);
  }
  w4a16_ = ops::moe_w4a16_device_layer(info, is_present);
  const cudaStream_t stream = uploader.stream();
  DeviceBuffer errors(sizeof(int32_t));
  BG_CUDA_CHECK(cudaMemsetAsync(errors.data(), 0, sizeof(int32_t), stream));  // ordered before the packs
  // A checkpoint-format expert takes about its block's bytes (the same codes and scales, less the alignment).
  const auto chunk_bytes = static_cast<size_t>(
      env_int("BG_MOE_W4A16_PACK_CHUNK_BYTES", 1, int64_t{1} << 40).value_or(kDevicePackChunkBytes));
  const size_t chunk = std::max<size_t>(1, chunk_bytes / static_cast<size_t>(info.block_bytes));
  for (size_t b = 0; b < slots.size(); b += chunk) {
    const size_t e = std::min(slots.size(), b + chunk);
    std::vector<const QuantWeight*> weights;
    for (size_t j = b; j < e; ++j) {
      const ops::MoeW4a16ExpertView& v = *present[slots[j]];
      weights.insert(weights.end(), {v.gate, v.up, v.down});
    }
    const std::vector<ops::DeviceWeightStorage> staged = uploader.upload(weights, static_cast<int64_t>(e - b));
    for (size_t j = b; j < e; ++j) {
      const size_t k = 3 * (j - b);
      void* block = w4a16_->storage.as<std::byte>() + j * static_cast<size_t>(info.block_bytes);  // j-th present
      ops::moe_w4a16_pack_cuda(info, {staged[k].desc, staged[k + 1].desc, staged[k + 2].desc}, block,
                               errors.as<int32_t>(), stream);
    }
    BG_CUDA_CHECK(cudaStreamSynchronize(stream));  // the packs read `staged`, freed with this iteration
  }
  const int32_t flags = download<int32_t>(errors, 1)[0];
  BG_CHECK(flags == 0, "prepare_experts: packing {} experts [{} x {}] into the W4A16 layout on the device raised MoE "
           "error flags {:#x} (a scale the layer's shifts cannot hold)", slots.size(), info.inter, info.hidden, flags);
}

void CudaExpertSlots::upload_blocks(const ops::MoeW4a16LayoutInfo& info,
                                    std::span<const ops::MoeW4a16ExpertView* const> present,
                                    WeightUploader& uploader) {
  std::vector<bool> is_present(present.size());
  std::vector<WeightUploader::RawCopy> copies;
  for (size_t s = 0; s < present.size(); ++s) {
    is_present[s] = present[s] != nullptr;
    if (!is_present[s]) continue;
    const std::span<const std::byte> b = present[s]->gate->w4a16.block;
    copies.push_back({{b.data(), b.size()}, copies.size() * static_cast<size_t>(info.block_bytes)});  // j-th present
  }
  w4a16_ = ops::moe_w4a16_device_layer(info, is_present);
  uploader.copy_bytes(copies, w4a16_->storage.as<std::byte>());
  log::debug("cuda moe: {} experts [{} x {}] uploaded as the weight store's W4A16 blocks", copies.size(), info.inter,
             info.hidden);
}

const QuantWeight* CudaExpertSlots::resolved(const QuantWeight* w) {
  if (!w->deferred()) return w;
  const QuantWeight*& r = resolved_of_[w];  // a view (slot) and the layer's list of experts name the same weight
  if (r == nullptr) {
    resolved_.push_back(w->resolved());
    r = &resolved_.back();
  }
  return r;
}

bool CudaExpertSlots::takes_blocks() const {
  if (!w4a16_ || !store_blocks_direct_wanted()) return false;
  const ops::MoeW4a16LayoutInfo& info = w4a16_->weights.info;
  return info.version == ops::kMoeW4a16LayoutVersion && info.gate_up.scale_shift == 0 && info.down.scale_shift == 0;
}

void CudaExpertSlots::lay_out(const LinearHandle& gate, const LinearHandle& up, const LinearHandle& down, Tensor& dst,
                              int32_t* error_flags, cudaStream_t stream) const {
  BG_CHECK(w4a16_, "lay_out_expert: the layer keeps no W4A16 layout");
  BG_CHECK(dst.device == DeviceKind::kCuda && dst.nbytes() >= layout_bytes(), "lay_out_expert: a block of {} bytes, "
           "the layout's is {}", dst.nbytes(), layout_bytes());
  ops::moe_w4a16_pack_cuda(w4a16_->weights.info, descs(gate, up, down), dst.data, error_flags, stream);
}

// prepare_linears left one layer's MXFP4 experts on the host (for the W4A16 layout); a layer that does not take the
// layout gets them as they are, one allocation for the slots that have no device copy.
void CudaExpertSlots::upload_deferred(WeightUploader& uploader) {
  std::vector<size_t> slots;
  std::vector<const QuantWeight*> weights;
  for (size_t i = 0; i < host_.size(); ++i) {
    if (host_[i].gate.data != nullptr && host_[i].up.data != nullptr && host_[i].down.data != nullptr) continue;
    slots.push_back(i);
    views_[i] = {resolved(views_[i].gate), resolved(views_[i].up), resolved(views_[i].down)};
    weights.insert(weights.end(), {views_[i].gate, views_[i].up, views_[i].down});
  }
  if (slots.empty()) return;
  uploaded_ = uploader.upload(weights, static_cast<int64_t>(slots.size()));
  for (size_t j = 0; j < slots.size(); ++j) {
    host_[slots[j]] = {uploaded_[3 * j].desc, uploaded_[3 * j + 1].desc, uploaded_[3 * j + 2].desc};
  }
}

void CudaExpertSlots::set(int64_t slot, const LinearHandle& gate, const LinearHandle& up, const LinearHandle& down,
                          const Tensor* laid_out, cudaStream_t stream) {
  BG_CHECK(slot >= 0 && slot < n_slots(), "set_expert_slot: slot {} of {}", slot, n_slots());
  const ops::ExpertWeightsCuda w = descs(gate, up, down);
  if (w4a16_) {  // the kernels read the slot's block: point it at the laid-out one
    BG_CHECK(laid_out != nullptr && laid_out->data != nullptr && laid_out->nbytes() >= layout_bytes(),
             "set_expert_slot: slot {} of a layer in the W4A16 layout needs its expert laid out (lay_out_expert)",
             slot);
    const auto i = static_cast<size_t>(slot);
    host_[i] = w;
    views_[i] = {&cuda_linear(gate).host(), &cuda_linear(up).host(), &cuda_linear(down).host()};
    w4a16_->host_table[i] = laid_out->data;
    // The host mirror is the copy's source: pageable memory is staged before cudaMemcpyAsync returns.
    BG_CUDA_CHECK(cudaMemcpyAsync(w4a16_->table.as<const void*>() + slot, &w4a16_->host_table[i], sizeof(void*),
                                  cudaMemcpyHostToDevice, stream));
    return;
  }
  const ops::DeviceWeight& g = gate0();
  BG_CHECK(w.gate.format == g.format && w.gate.n_out == g.n_out && w.gate.n_in == g.n_in &&
               w.down.n_out == host_[0].down.n_out && w.down.n_in == host_[0].down.n_in && w.gate.data != nullptr,
           "set_expert_slot: slot {} gets a [{}, {}] {} expert; the layer's experts are [{}, {}] {} on the device",
           slot, w.gate.n_out, w.gate.n_in, weight_format_name(w.gate.format), g.n_out, g.n_in,
           weight_format_name(g.format));
  const auto i = static_cast<size_t>(slot);
  host_[i] = w;
  views_[i] = {&cuda_linear(gate).host(), &cuda_linear(up).host(), &cuda_linear(down).host()};
  // The host mirror is the copy's source: pageable memory is staged before cudaMemcpyAsync returns.
  BG_CUDA_CHECK(cudaMemcpyAsync(dev_.as<ops::ExpertWeightsCuda>() + slot, &host_[i], sizeof(w),
                                cudaMemcpyHostToDevice, stream));
}

void moe_dispatch(const MoeContext& c, const Tensor& slot_map, const Tensor& ids, const Tensor& weights,
                  MoeRouting& r, const int32_t* live_tokens, int64_t live_row0) {
  BG_CHECK(slot_map.numel() == r.shape.n_experts && ids.numel() == r.shape.n_pairs() &&
               weights.numel() == r.shape.n_pairs(), "moe_dispatch: slot map of {} for {} experts, {} ids and {} "
           "weights for {} pairs", slot_map.numel(), r.shape.n_experts, ids.numel(), weights.numel(),
           r.shape.n_pairs());
  ops::MoeWorkspace ws = workspace(c, r);
  ws.slot_map = slot_map.as<int32_t>();
  ws.live_tokens = live_tokens;
  ws.live_row0 = static_cast<int32_t>(std::max<int64_t>(live_row0, 0));
  ops::moe_dispatch_cuda(params(r, 1, 1), ids.as<int32_t>(), weights.as<float>(), ws, c.stream);
}

void moe_gather(const MoeContext& c, const MoeRouting& r, const Tensor& x, Tensor& rows) {
  expect_bf16(x, "moe_gather input");
  ops::MoeWorkspace ws = workspace(c, r);
  ws.x_perm = rows.as<bf16>();
  ops::moe_gather_cuda(params(r, x.cols(), 1), x.as<bf16>(), ws, c.stream);
}

void* MoeGroupedScratch::ensure(CachingAllocator& alloc, size_t bytes) {
  if (bytes_ < bytes) {
    reset();  // release first: the old and new scratch need not fit together
    mem_ = alloc.allocate(bytes);
    bytes_ = bytes;
    log::info("cuda moe: grouped prefill weight scratch of {} MiB", bytes >> 20);
  }
  return mem_.get();
}

ops::MoeFp8Gemm& MoeGroupedScratch::fp8_gemm() {
  if (!fp8_gemm_) fp8_gemm_ = std::make_unique<ops::MoeFp8Gemm>();
  return *fp8_gemm_;
}

namespace {

std::atomic<uint64_t> g_grouped_calls{0};

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
  BG_CUDA_CHECK(cudaStreamIsCapturing(stream, &s));
  return s != cudaStreamCaptureStatusNone;
}

// Whether this call takes the grouped path (never under --deterministic). Under graph capture it cannot (its plan
// reads the row counts on the host); captured steps are decode-sized (B <= 64), far below the threshold, so this only
// matters for an override.
// `fused_alternative`: the layer has the W4A16 kernel, which takes over below kMoeGroupedMinRowsW4a16 rows per expert
// (unless BG_MOE_GROUPED_MIN_ROWS says otherwise); else the tiled kernel is the alternative, below the default.
bool use_grouped(const MoeContext& c, const ops::MoeCudaParams& p, bool fused_alternative = false) {
  if (c.grouped_scratch == nullptr || c.blas.cublas == nullptr) return false;
  if (c.deterministic) return false;  // chosen by rows per expert, i.e. by the batch (docs/DETERMINISM.md)
  const char* env = std::getenv("BG_MOE_GROUPED_MIN_ROWS");
  const bool env_set = env != nullptr && *env != '\0';
  const int64_t min_rows =
      fused_alternative && !env_set ? ops::kMoeGroupedMinRowsW4a16 : ops::moe_grouped_min_rows(env);
  if (!ops::moe_grouped_wanted(p.shape.n_tokens, p.shape.top_k, p.shape.n_experts, min_rows)) return false;
  if (capturing(c.stream)) {
    log::debug("cuda moe: {} tokens reach the grouped threshold under graph capture: tiled kernel", p.shape.n_tokens);
    return false;
  }
  return true;
}

// Dequantize-once + grouped GEMMs (ops/moe/moe_grouped_cuda.h). Synchronises the stream once (the row counts).
void run_grouped(const MoeContext& c, const CudaExpertSlots& slots, const ops::MoeCudaParams& p,
                 const ops::MoeWorkspace& ws) {
  const int64_t per_group = ops::moe_grouped_group_experts(p.hidden, p.inter, ops::kMoeGroupedScratchBudgetBytes);
  const ops::MoeGroupedPlan plan = ops::moe_grouped_plan_from_device(p, ws, per_group, c.stream);
  const size_t weight_bytes =
      static_cast<size_t>(std::min(per_group, slots.n_slots())) * ops::moe_grouped_expert_bytes(p.hidden, p.inter);
  ops::MoeGroupedArgs a;
  a.plan = &plan;
  a.experts = slots.stages() ? slots.device() : nullptr;
  a.packed = slots.w4a16();  // preferred: the only copy of a packed layer
  a.ws = ws;
  a.ctx = c.blas;
  a.ctx.api = ops::moe_grouped_gemm_api(std::getenv("BG_MOE_GROUPED_GEMM"));
  a.bufs.weights = static_cast<bf16*>(c.grouped_scratch->ensure(*c.alloc, weight_bytes));
  a.bufs.weight_bytes = c.grouped_scratch->bytes();
  // Per call, freed in stream order: gate|up outputs of the largest group and the GEMMs' pointer arrays.
  std::shared_ptr<void> gu = c.alloc->allocate(std::max<size_t>(ops::moe_grouped_gu_bytes(plan), 1));
  std::shared_ptr<void> ptrs = c.alloc->allocate(std::max<size_t>(ops::moe_grouped_pointer_bytes(plan), 1));
  a.bufs.gu = static_cast<bf16*>(gu.get());
  a.bufs.gu_bytes = ops::moe_grouped_gu_bytes(plan);
  a.bufs.pointers = static_cast<void**>(ptrs.get());
  a.bufs.pointer_bytes = ops::moe_grouped_pointer_bytes(plan);
  ops::moe_grouped_write_pointers(a, c.stream);
  ops::moe_expert_ffn_grouped_cuda(p, a, c.stream);
  g_grouped_calls.fetch_add(1, std::memory_order_relaxed);
}

std::atomic<uint64_t> g_w4a16_prefill_calls{0};
std::atomic<uint64_t> g_fp8_prefill_calls{0};

// BG_MOE_PREFILL, read once per process (ops::MoePrefillKernel).
ops::MoePrefillKernel prefill_mode() {
  static const ops::MoePrefillKernel mode = ops::moe_prefill_kernel(std::getenv("BG_MOE_PREFILL"));
  return mode;
}

// Rows per expert from which the prefill kernels (W4A16, FP8) run: BG_MOE_GROUPED_MIN_ROWS when set, else
// kMoeW4a16PrefillMinRows.
int64_t prefill_min_rows() {
  const char* env = std::getenv("BG_MOE_GROUPED_MIN_ROWS");
  return env != nullptr && *env != '\0' ? ops::moe_grouped_min_rows(env) : ops::kMoeW4a16PrefillMinRows;
}

// Whether a call takes the FP8 prefill path (BG_MOE_PREFILL=fp8 only: it rounds activations to E4M3): a layer it
// supports, from kMoeW4a16PrefillMinRows rows per expert (BG_MOE_GROUPED_MIN_ROWS when set), never under
// --deterministic or graph capture (its plan reads the row counts on the host, as the grouped path's).
bool use_fp8_prefill(const MoeContext& c, const CudaExpertSlots& slots, const ops::MoeCudaParams& p) {
  if (prefill_mode() != ops::MoePrefillKernel::kFp8 || c.grouped_scratch == nullptr || c.deterministic) return false;
  if (!ops::moe_fp8_supported(p, slots.w4a16() != nullptr, slots.stages())) return false;
  if (!ops::moe_grouped_wanted(p.shape.n_tokens, p.shape.top_k, p.shape.n_experts, prefill_min_rows())) return false;
  return !capturing(c.stream);
}

// x_perm -> y_perm on the FP8 path (ops/moe/moe_fp8_cuda.h). Synchronises the stream once (the row counts). The
// converted experts of a group live in the grouped path's scratch (half its bf16 size); the quantized rows, scales
// and gate|up outputs in one per-call buffer freed in stream order.
void run_fp8_prefill(const MoeContext& c, const CudaExpertSlots& slots, const ops::MoeCudaParams& p,
                     const ops::MoeWorkspace& ws) {
  const int64_t per_group = ops::moe_grouped_group_experts(p.hidden, p.inter, ops::kMoeGroupedScratchBudgetBytes);
  const ops::MoeGroupedPlan plan = ops::moe_grouped_plan_from_device(p, ws, per_group, c.stream);
  ops::MoeFp8Args a;
  a.plan = &plan;
  a.packed = slots.w4a16();
  a.experts_host = a.packed != nullptr ? nullptr : slots.host().data();
  a.ws = ws;
  if (a.packed != nullptr) {
    const size_t bytes = static_cast<size_t>(std::min(per_group, slots.n_slots())) *
                         ops::moe_fp8_expert_layout(p.hidden, p.inter).bytes;
    a.expert_scratch = c.grouped_scratch->ensure(*c.alloc, bytes);
    a.expert_scratch_bytes = c.grouped_scratch->bytes();
  }
  const size_t call_bytes = ops::moe_fp8_call_layout(plan).bytes;
  std::shared_ptr<void> call = c.alloc->allocate(std::max<size_t>(call_bytes, 1));
  a.call_buffer = call.get();
  a.call_buffer_bytes = call_bytes;
  a.gemm = &c.grouped_scratch->fp8_gemm();
  a.cublas_workspace = c.blas.cublas_workspace;
  a.cublas_workspace_bytes = c.blas.cublas_workspace_bytes;
  ops::moe_fp8_write_table(plan, a.call_buffer, a.call_buffer_bytes, c.stream);
  ops::moe_expert_ffn_fp8_cuda(p, a, c.stream);
  g_fp8_prefill_calls.fetch_add(1, std::memory_order_relaxed);
}

// Whether a call of a layer with the W4A16 layout runs the W4A16 prefill kernel (BG_MOE_PREFILL, read once per
// process: ops::MoePrefillKernel): by rows per expert, from kMoeW4a16PrefillMinRows (BG_MOE_GROUPED_MIN_ROWS when set)
// and, by default, below kMoeW4a16PrefillMaxRows; never under --deterministic (the kernel would be chosen by the
// batch's rows per expert). Graph capture included: the kernel needs no cuBLAS and no host synchronisation, and in a
// captured decode step of 128 / 256 sequences (37 / 73 rows per expert) it beats the decode kernel's further passes
// over each expert's weights: the slice's step 7.78 against 8.25 ms and 11.09 against 13.12 ms (H100, 2026-12-07).
bool use_w4a16_prefill(const MoeContext& c, const ops::MoeCudaParams& p, bool has_w4a16) {
  const ops::MoePrefillKernel mode = prefill_mode();
  // h between its kernels is the dispatch's [rows, inter] buffer in the kernel's permuted layout, whose rows are
  // padded to whole 64-input stages: inter a multiple of 64 (K3, DeepSeek-V3) keeps them the same size.
  if (mode == ops::MoePrefillKernel::kGrouped || mode == ops::MoePrefillKernel::kFp8 || !has_w4a16 ||
      c.deterministic || p.inter % ops::w4::kKStage != 0) {
    return false;
  }
  const auto [n, k, e] = std::tuple{p.shape.n_tokens, p.shape.top_k, p.shape.n_experts};
  if (!ops::moe_grouped_wanted(n, k, e, prefill_min_rows())) return false;
  if (mode == ops::MoePrefillKernel::kW4a16) return true;
  return !ops::moe_grouped_wanted(n, k, e, ops::kMoeW4a16PrefillMaxRows);
}

// x -> h (ws.h) -> y_rows on the W4A16 prefill kernel (ops/moe_w4a16/moe_w4a16_prefill_cuda.h): x the rows in
// dispatch order, or with `gather` the tokens (read through the dispatch's row_token). Its workspace (the plan and x
// in its permuted layout) is taken per call from the caching allocator and freed in stream order.
void run_w4a16_prefill(const MoeContext& c, const ops::MoeW4a16Weights& w, const ops::MoeCudaParams& p,
                       const ops::MoeWorkspace& ws, const Tensor& x, bool gather, Tensor& y_rows) {
  const ops::MoeW4a16Params wp = ops::moe_w4a16_rows_params(p);
  std::shared_ptr<void> mem = c.alloc->allocate(ops::moe_w4a16_prefill_workspace_bytes(wp, gather));
  ops::moe_w4a16_prefill_cuda(wp, w, ws, {x.as<bf16>(), gather, ws.h, y_rows.as<bf16>(), mem.get()}, c.stream);
  g_w4a16_prefill_calls.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

uint64_t moe_grouped_calls() { return g_grouped_calls.load(std::memory_order_relaxed); }
uint64_t moe_w4a16_prefill_calls() { return g_w4a16_prefill_calls.load(std::memory_order_relaxed); }
uint64_t moe_fp8_prefill_calls() { return g_fp8_prefill_calls.load(std::memory_order_relaxed); }

void moe_experts(const MoeContext& c, const CudaExpertSlots& slots, const GluSpec& glu, const MoeRouting& r,
                 const Tensor& rows, Tensor& y_rows) {
  expect_bf16(rows, "moe_experts input");
  BG_CHECK(slots.n_slots() == r.shape.n_slots, "moe_experts: {} prepared slots for a routing over {}",
           slots.n_slots(), r.shape.n_slots);
  const ops::DeviceWeight& g0 = slots.gate0();
  ops::MoeCudaParams p = params(r, rows.cols(), g0.n_out);
  p.expert_format = g0.format;
  p.act = glu_params(glu);
  ops::MoeWorkspace ws = workspace(c, r);
  ws.x_perm = rows.as<bf16>();
  ws.y_perm = y_rows.as<bf16>();
  if (use_fp8_prefill(c, slots, p)) {  // its h is E4M3 in its own call buffer
    run_fp8_prefill(c, slots, p, ws);
    return;
  }
  std::shared_ptr<void> h = c.alloc->allocate(static_cast<size_t>(r.shape.n_pairs() * g0.n_out) * sizeof(bf16));
  ws.h = static_cast<bf16*>(h.get());  // [n_pairs, inter] GLU outputs, freed in stream order
  const ops::MoeW4a16Weights* w = slots.w4a16();
  if (use_w4a16_prefill(c, p, w != nullptr)) {
    run_w4a16_prefill(c, *w, p, ws, rows, false, y_rows);
    return;
  }
  if (use_grouped(c, p, w != nullptr)) {
    run_grouped(c, slots, p, ws);
    return;
  }
  if (w != nullptr) {  // rows in, rows out: the rows an exchange delivered (or the stage path's gathered rows)
    const ops::MoeW4a16Params wp = ops::moe_w4a16_rows_params(p, c.deterministic ? 1 : 0);
    std::shared_ptr<void> mem = c.alloc->allocate(ops::moe_w4a16_workspace_bytes(wp));
    const ops::MoeW4a16Workspace wws = ops::moe_w4a16_workspace_layout(wp, mem.get());
    ops::moe_w4a16_workspace_init(wws, c.stream);
    ops::moe_w4a16_cuda(wp, *w, ws, {rows.as<bf16>(), y_rows.data}, wws, c.stream);
    return;
  }
  BG_CHECK(slots.stages(), "moe_experts: the layer's experts have no device copy for the stage kernels");
  ops::moe_expert_ffn_cuda(p, slots.device(), ws, c.stream);
}

void moe_combine(const MoeContext& c, const MoeRouting& r, const Tensor& y_rows, Tensor& out, bool accumulate) {
  ops::MoeCudaParams p = params(r, out.cols(), 1);
  p.out_type = out.dtype == DType::kF32 ? ops::MoeOutType::kF32 : ops::MoeOutType::kBf16;
  p.accumulate = accumulate;
  ops::MoeWorkspace ws = workspace(c, r);
  ws.y_perm = y_rows.as<bf16>();
  ops::moe_combine_cuda(p, ws, out.data, c.stream);
}

MoeLocalPath moe_routed_local(const MoeContext& c, const CudaExpertSlots& slots, const GluSpec& glu,
                              const MoeRouting& r, const Tensor& x_in, Tensor& out, bool accumulate) {
  const ops::MoeW4a16Weights* w = slots.w4a16();
  ops::MoeCudaParams p = params(r, x_in.cols(), slots.gate0().n_out);
  p.expert_format = slots.gate0().format;
  p.act = glu_params(glu);
  p.out_type = out.dtype == DType::kF32 ? ops::MoeOutType::kF32 : ops::MoeOutType::kBf16;
  p.accumulate = accumulate;
  // By rows per expert (docs/MOE_PREFILL.md's table): the W4A16 prefill kernel first (by default at 32-511, captured
  // decode steps included), then the grouped prefill path (taken inside moe_experts) when its threshold says so
  // (BG_MOE_GROUPED_MIN_ROWS can lower both, e.g. for the golden tests), else the decode kernel.
  // Where neither runs — a captured step past 511 rows per expert (the grouped path reads row counts on the host),
  // no scratch — the fused kernel takes any row count (further passes over each expert's weights). With the fused
  // kernel at hand the grouped path waits for kMoeGroupedMinRowsW4a16 rows per expert. Deterministic: the fused
  // kernel whatever the row count (a choice by rows per expert depends on the batch; use_grouped never picks the
  // grouped path then).
  const auto alloc_bf16 = [&](int64_t rows, int64_t cols) {
    return alloc_tensor(*c.alloc, {rows, cols}, DType::kBF16);
  };
  const bool prefill_kernel = w != nullptr && r.shape.all_local && use_w4a16_prefill(c, p, true);
  const bool fused = w != nullptr && r.shape.all_local && !use_grouped(c, p, true) && !use_fp8_prefill(c, slots, p);
  // A strided x (a fused group's part, Tensor::cols_view) is read in place by the decode kernel; the other paths get
  // it packed.
  const Tensor x = prefill_kernel || !fused ? packed_copy(*c.alloc, x_in, c.stream) : x_in;
  if (prefill_kernel) {
    // The W4A16 prefill kernel reads x through the dispatch's row_token (no gathered rows buffer), then the combine.
    expect_bf16(x, "moe input");
    Tensor h = alloc_bf16(r.shape.n_pairs(), slots.gate0().n_out);
    Tensor y = alloc_bf16(r.shape.n_pairs(), x.cols());
    ops::MoeWorkspace ws = workspace(c, r);
    ws.h = h.as<bf16>();
    run_w4a16_prefill(c, *w, p, ws, x, true, y);
    moe_combine(c, r, y, out, accumulate);
    return MoeLocalPath::kW4a16Prefill;
  }
  if (!fused) {
    Tensor rows = alloc_bf16(r.shape.n_pairs(), x.cols());
    Tensor y = alloc_bf16(r.shape.n_pairs(), x.cols());
    moe_gather(c, r, x, rows);
    moe_experts(c, slots, glu, r, rows, y);
    moe_combine(c, r, y, out, accumulate);
    return MoeLocalPath::kStages;
  }
  expect_bf16(x, "moe input");
  const ops::MoeW4a16Params wp = ops::moe_w4a16_params(p, c.deterministic ? 1 : 0);
  std::shared_ptr<void> mem = c.alloc->allocate(ops::moe_w4a16_workspace_bytes(wp));
  const ops::MoeW4a16Workspace ws = ops::moe_w4a16_workspace_layout(wp, mem.get());
  ops::moe_w4a16_workspace_init(ws, c.stream);  // stream-ordered memset of the counters (capturable)
  ops::moe_w4a16_cuda(wp, *w, workspace(c, r), {x.strided_as<bf16>(), out.data, x.packed() ? 0 : x.ld()}, ws, c.stream);
  return MoeLocalPath::kW4a16;
}

}  // namespace bg::cuda
