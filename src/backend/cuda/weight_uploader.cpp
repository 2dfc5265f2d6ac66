// WeightUploader: device layout of a batch, then staged windows (conversions, pageable sources) and direct copies
// from pinned memory, in that order on one stream (a direct copy may span padding a staged window also wrote).
#include "backend/cuda/weight_uploader.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "core/log.h"
#include "formats/expert_block.h"

namespace bg::cuda {
namespace {

constexpr size_t kStagingBytes = size_t{64} << 20;  // per buffer; two buffers alternate
constexpr size_t kMaxCopyGap = size_t{1} << 20;     // padding copied along rather than starting a new copy

// Bytes the host weight must hold: {data, scale}; throws naming the weight when it does not.
std::pair<size_t, size_t> host_bytes(const QuantWeight& w) {
  BG_CHECK(w.n_out > 0 && w.n_in > 0, "upload '{}': empty weight [{}, {}]", w.name, w.n_out, w.n_in);
  const size_t n = static_cast<size_t>(w.n_out) * static_cast<size_t>(w.n_in);
  switch (w.format) {
    case WeightFormat::kDense:
      BG_CHECK(w.data.dtype == DType::kBF16 || w.data.dtype == DType::kF32 || w.data.dtype == DType::kF16,
               "upload '{}': dense dtype {} is not F32/F16/BF16", w.name, dtype_name(w.data.dtype));
      return {n * dtype_size_bytes(w.data.dtype), 0};
    case WeightFormat::kFp8Block:
      BG_CHECK(w.scale.dtype == DType::kF32, "upload '{}': FP8 scale dtype {} is not F32", w.name,
               dtype_name(w.scale.dtype));
      return {n, static_cast<size_t>(((w.n_out + 127) / 128) * ((w.n_in + 127) / 128)) * sizeof(float)};
    case WeightFormat::kMxfp4:
      BG_CHECK(w.n_in % kMxfp4GroupSize == 0, "upload '{}': MXFP4 input dim {} is not a multiple of 32", w.name,
               w.n_in);
      return {n / 2, n / kMxfp4GroupSize};
  }
  fail("upload '{}': unknown format", w.name);
}

}  // namespace

struct WeightUploader::Registry {
  std::mutex mu;
  std::vector<HostRegion> regions;  // sorted by address

  // The registered region holding [p, p + n), or null.
  const HostRegion* find(const std::byte* p, size_t n) {
    std::lock_guard lock(mu);
    auto it = std::upper_bound(regions.begin(), regions.end(), p,
                               [](const std::byte* x, const HostRegion& r) { return x < r.data; });
    if (it == regions.begin()) return nullptr;
    --it;
    return p >= it->data && p + n <= it->data + it->bytes ? &*it : nullptr;
  }
};

// One copy: `bytes` source bytes at src -> dst_bytes at offset dst of the batch allocation; dense F32/F16 sources are
// rounded to bf16 on the way (2 destination bytes per element).
struct WeightUploader::Op {
  const std::byte* src = nullptr;
  size_t bytes = 0;       // source bytes
  size_t dst = 0;         // offset in the batch allocation
  size_t dst_bytes = 0;
  DType convert_from = DType::kU8;  // kF32 / kF16: round to bf16; otherwise copied as is
  const HostRegion* pinned = nullptr;
};

WeightUploader::WeightUploader(cudaStream_t stream) : stream_(stream), registry_(std::make_shared<Registry>()) {
  for (auto& e : staged_) BG_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

WeightUploader::~WeightUploader() {
  for (auto* s : staging_) {
    if (s != nullptr) cudaFreeHost(s);
  }
  for (auto e : staged_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

std::shared_ptr<void> WeightUploader::pin(std::span<const HostRegion> regions) {
  const auto t0 = std::chrono::steady_clock::now();
  auto done = std::make_shared<std::vector<HostRegion>>();
  uint64_t bytes = 0;
  for (const HostRegion& r : regions) {
    const cudaError_t err = cudaHostRegister(const_cast<std::byte*>(r.data), r.bytes,
                                             cudaHostRegisterPortable | cudaHostRegisterReadOnly);
    if (err == cudaErrorHostMemoryAlreadyRegistered) {
      cudaGetLastError();  // already pinned (e.g. a weight store segment): copies from it run at the DMA rate
      continue;
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      log::warn("cuda: cannot pin {} bytes of weight memory ({}); its uploads go through pinned staging", r.bytes,
                cudaGetErrorString(err));
      continue;
    }
    done->push_back(r);
    bytes += r.bytes;
  }
  {
    std::lock_guard lock(registry_->mu);
    registry_->regions.insert(registry_->regions.end(), done->begin(), done->end());
    std::sort(registry_->regions.begin(), registry_->regions.end(),
              [](const HostRegion& a, const HostRegion& b) { return a.data < b.data; });
  }
  if (!done->empty()) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log::info("cuda: pinned {} weight regions ({:.2f} GB) in {:.2f} s", done->size(), static_cast<double>(bytes) / 1e9,
              s);
  }
  return std::shared_ptr<void>(new char(0), [registry = registry_, done](void* p) {
    std::lock_guard lock(registry->mu);
    for (const HostRegion& r : *done) {
      cudaHostUnregister(const_cast<std::byte*>(r.data));
      std::erase_if(registry->regions, [&](const HostRegion& x) { return x.data == r.data; });
    }
    delete static_cast<char*>(p);
  });
}

void WeightUploader::copy_staged(std::vector<Op>& ops, std::byte* device) {
  if (ops.empty()) return;
  for (int b = 0; b < 2; ++b) {
    if (staging_[b] == nullptr) {
      void* p = nullptr;
      BG_CUDA_CHECK(cudaMallocHost(&p, kStagingBytes));
      staging_[b] = static_cast<std::byte*>(p);
    }
  }
  // Split ops larger than a window (at element boundaries for conversions).
  std::vector<Op> pieces;
  for (const Op& op : ops) {
    const size_t in_elem = op.convert_from == DType::kU8 ? 1 : dtype_size_bytes(op.convert_from);
    const size_t out_elem = op.convert_from == DType::kU8 ? 1 : 2;
    const size_t max_elems = kStagingBytes / out_elem;
    for (size_t e = 0; e * in_elem < op.bytes; e += max_elems) {
      const size_t n = std::min(max_elems, op.bytes / in_elem - e);
      pieces.push_back({op.src + e * in_elem, n * in_elem, op.dst + e * out_elem, n * out_elem, op.convert_from, nullptr});
    }
  }
  std::sort(pieces.begin(), pieces.end(), [](const Op& a, const Op& b) { return a.dst < b.dst; });
  int buf = 0;
  for (size_t i = 0; i < pieces.size();) {
    const size_t w0 = pieces[i].dst;
    size_t end = w0;
    BG_CUDA_CHECK(cudaEventSynchronize(staged_[buf]));  // the copy that last read this buffer is done
    for (; i < pieces.size() && pieces[i].dst + pieces[i].dst_bytes <= w0 + kStagingBytes; ++i) {
      const Op& p = pieces[i];
      std::byte* out = staging_[buf] + (p.dst - w0);
      if (p.convert_from == DType::kU8) {
        std::memcpy(out, p.src, p.bytes);
      } else {
        auto* o = reinterpret_cast<uint16_t*>(out);
        const auto n = static_cast<int64_t>(p.dst_bytes / 2);
        for (int64_t k = 0; k < n; ++k) o[k] = f32_to_bf16(load_as_f32(p.src, p.convert_from, k));
      }
      end = std::max(end, p.dst + p.dst_bytes);
    }
    BG_CUDA_CHECK(cudaMemcpyAsync(device + w0, staging_[buf], end - w0, cudaMemcpyHostToDevice, stream_));
    BG_CUDA_CHECK(cudaEventRecord(staged_[buf], stream_));
    bytes_staged_ += end - w0;
    buf ^= 1;
  }
}

void WeightUploader::copy_pinned(std::vector<Op>& ops, std::byte* device) {
  for (const Op& op : ops) {
    BG_CUDA_CHECK(cudaMemcpyAsync(device + op.dst, op.src, op.bytes, cudaMemcpyHostToDevice, stream_));
  }
}

std::vector<ops::DeviceWeightStorage> WeightUploader::upload(std::span<const QuantWeight* const> ws,
                                                             int64_t n_experts, std::span<const LinearRun> glued) {
  const size_t n = ws.size();
  BG_CHECK(n_experts <= 0 || n % static_cast<size_t>(n_experts) == 0, "upload: {} weights are not {} equal experts",
           n, n_experts);
  // Device layout: parts 256-byte aligned; with experts, each expert one 4 KiB-aligned block.
  std::vector<size_t> off(2 * n);
  size_t cursor = 0;
  BG_CHECK(glued.empty() || n_experts <= 0, "upload: glued runs in a batch of experts");
  std::vector<bool> after_previous(n, false);  // weight i starts where weight i - 1's data ends
  for (const LinearRun& r : glued) {
    BG_CHECK(r.first + r.count <= n, "upload: run [{}, {}) past {} weights", r.first, r.first + r.count, n);
    for (size_t i = r.first + 1; i < r.first + r.count; ++i) after_previous[i] = true;
  }
  size_t previous_scale = 0;
  for (size_t i = 0; i < n && n_experts <= 0; ++i) {
    auto [d, s] = ops::device_weight_bytes(*ws[i]);
    BG_CHECK(!after_previous[i] || previous_scale == 0, "upload: '{}' is glued after a weight with scales",
             ws[i]->name);
    off[2 * i] = after_previous[i] ? cursor : align_up(cursor, kWeightPartAlign);
    off[2 * i + 1] = align_up(off[2 * i] + d, kWeightPartAlign);
    cursor = s > 0 ? off[2 * i + 1] + s : off[2 * i] + d;
    previous_scale = s;
  }
  cursor = align_up(cursor, kWeightPartAlign);
  const size_t run = n_experts > 0 ? n / static_cast<size_t>(n_experts) : n;
  for (size_t b = 0; b < n && n_experts > 0; b += run) {
    std::vector<size_t> parts;
    for (size_t i = b; i < b + run; ++i) {
      auto [d, s] = ops::device_weight_bytes(*ws[i]);
      parts.push_back(d);
      parts.push_back(s);
    }
    const ExpertBlockLayout lay = expert_block_layout(parts);
    const size_t base = align_up(cursor, n_experts > 0 ? kWeightBlockAlign : kWeightPartAlign);
    for (size_t k = 0; k < parts.size(); ++k) off[2 * b + k] = base + lay.part_offsets[k];
    cursor = base + (n_experts > 0 ? lay.bytes : align_up(lay.part_offsets.back() + parts.back(), kWeightPartAlign));
  }
  auto arena = std::make_shared<DeviceBuffer>(cursor);
  auto* device = static_cast<std::byte*>(arena->data());
  std::vector<Op> all;
  for (size_t i = 0; i < n; ++i) {
    const QuantWeight& w = *ws[i];
    auto [hd, hs] = host_bytes(w);
    auto [dd, ds] = ops::device_weight_bytes(w);
    BG_CHECK(w.data.data != nullptr && w.data.nbytes == hd, "upload '{}': data holds {} bytes, {} expected", w.name,
             w.data.nbytes, hd);
    BG_CHECK(hs == 0 || (w.scale.data != nullptr && w.scale.nbytes == hs), "upload '{}': scale holds {} bytes, {} "
             "expected", w.name, w.scale.nbytes, hs);
    const bool convert = w.format == WeightFormat::kDense && w.data.dtype != DType::kBF16;
    all.push_back({w.data.data, hd, off[2 * i], dd, convert ? w.data.dtype : DType::kU8,
                   convert ? nullptr : registry_->find(w.data.data, hd)});
    if (hs > 0) all.push_back({w.scale.data, hs, off[2 * i + 1], ds, DType::kU8, registry_->find(w.scale.data, hs)});
  }
  copy_all(all, device);
  BG_CUDA_CHECK(cudaStreamSynchronize(stream_));
  bytes_uploaded_ += cursor;
  std::vector<ops::DeviceWeightStorage> out(n);
  for (size_t i = 0; i < n; ++i) {
    const QuantWeight& w = *ws[i];
    out[i].desc = ops::DeviceWeight{w.format, w.n_out, w.n_in, device + off[2 * i],
                                    w.format == WeightFormat::kDense ? nullptr : device + off[2 * i + 1]};
    out[i].arena = arena;
  }
  return out;
}

void WeightUploader::copy_bytes(std::span<const RawCopy> copies, std::byte* device) {
  std::vector<Op> all;
  size_t bytes = 0;
  for (const RawCopy& c : copies) {
    BG_CHECK(c.src.data != nullptr || c.src.bytes == 0, "copy_bytes: a null source of {} bytes", c.src.bytes);
    all.push_back({c.src.data, c.src.bytes, c.dst, c.src.bytes, DType::kU8, registry_->find(c.src.data, c.src.bytes)});
    bytes += c.src.bytes;
  }
  copy_all(all, device);
  BG_CUDA_CHECK(cudaStreamSynchronize(stream_));
  bytes_uploaded_ += bytes;
}

void WeightUploader::copy_all(std::vector<Op>& all, std::byte* device) {
  // In device order, adjacent direct copies from one pinned region merge when the source and destination gaps match
  // (store padding copied into device padding); a staged op in between always breaks the run.
  std::sort(all.begin(), all.end(), [](const Op& a, const Op& b) { return a.dst < b.dst; });
  std::vector<Op> pinned, staged;
  size_t staged_at_last_pinned = 0;
  for (const Op& op : all) {
    if (op.pinned == nullptr) {
      staged.push_back(op);
      continue;
    }
    if (!pinned.empty() && staged_at_last_pinned == staged.size()) {
      Op& last = pinned.back();
      const std::byte* src_end = last.src + last.bytes;
      const size_t dst_end = last.dst + last.bytes;
      if (last.pinned == op.pinned && op.src >= src_end && op.dst >= dst_end &&
          static_cast<size_t>(op.src - src_end) == op.dst - dst_end && op.dst - dst_end <= kMaxCopyGap) {
        last.bytes = op.dst + op.bytes - last.dst;
        continue;
      }
    }
    pinned.push_back(op);
    staged_at_last_pinned = staged.size();
  }
  copy_staged(staged, device);
  copy_pinned(pinned, device);
}

}  // namespace bg::cuda
