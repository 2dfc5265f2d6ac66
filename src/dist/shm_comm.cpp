// Shared-memory collectives: member slots, rounds, chunking.
#include "dist/shm_comm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "core/log.h"

namespace bg::dist {
namespace {

constexpr size_t kControlBytes = 4096;  // ShmControl, page aligned
constexpr size_t kSlotHeaderBytes = 64;

struct SlotHeader {
  uint32_t seq;      // futex word: the last round this member posted
  uint32_t pad;
  uint64_t size[2];  // bytes posted in each buffer
};
static_assert(sizeof(SlotHeader) <= kSlotHeaderBytes);
static_assert(sizeof(ShmControl) <= kControlBytes);

size_t member_bytes(size_t slot_bytes) { return kSlotHeaderBytes + 2 * slot_bytes; }

// A channel: `n_members` consecutive member slots starting at `base`.
class ShmChannelComm final : public Comm {
 public:
  ShmChannelComm(const ShmSet& set, std::byte* base, int32_t n_members, int32_t member, int32_t first_rank,
                 size_t slot_bytes)
      : set_(set), base_(base), n_(n_members), me_(member), first_rank_(first_rank), slot_(slot_bytes) {}

  std::string_view transport() const override { return "shm"; }
  int32_t rank() const override { return me_; }
  int32_t size() const override { return n_; }

  // Device tensors (CUDA ranks whose set talks through shared memory: the ll exchange's rank sets) go through host
  // fp32 copies: download (synchronises the backend), the host collective, upload into the same tensor.
  void all_reduce_sum(Backend& be, Tensor& t) override {
    if (t.device != DeviceKind::kCpu) {
      Tensor h = to_host(be, t);
      all_reduce_sum(be, h);
      from_host(be, h, t);
      return;
    }
    float* p = host_f32(t, "all_reduce_sum");
    const size_t n = static_cast<size_t>(t.numel()), per = slot_ / sizeof(float);
    std::vector<float> acc;
    for (size_t off = 0; off < n || off == 0; off += per) {
      const size_t cnt = std::min(per, n - off);
      post_and_wait(reinterpret_cast<const std::byte*>(p + off), cnt * sizeof(float));
      acc.assign(cnt, 0.0f);
      std::memcpy(acc.data(), part(0).data(), cnt * sizeof(float));
      for (int32_t m = 1; m < n_; ++m) {  // member order: the same bits on every member
        const float* q = reinterpret_cast<const float*>(part(m).data());
        for (size_t i = 0; i < cnt; ++i) acc[i] += q[i];
      }
      std::memcpy(p + off, acc.data(), cnt * sizeof(float));
      if (n == 0) break;
    }
  }

  void all_gather(Backend& be, const Tensor& in, Tensor& out) override {
    if (in.device != DeviceKind::kCpu || out.device != DeviceKind::kCpu) {
      BG_CHECK(out.numel() == in.numel() * n_, "shm all_gather: {} values out for {} x {}", out.numel(), n_,
               in.numel());
      const Tensor h_in = to_host(be, in);
      Tensor h_out = host_f32_tensor(out.shape);
      all_gather(be, h_in, h_out);
      from_host(be, h_out, out);
      return;
    }
    BG_CHECK(in.device == DeviceKind::kCpu && out.device == DeviceKind::kCpu && in.dtype == out.dtype &&
                 out.nbytes() == in.nbytes() * static_cast<size_t>(n_),
             "shm all_gather: {} bytes in, {} out for {} members", in.nbytes(), out.nbytes(), n_);
    const auto* src = static_cast<const std::byte*>(in.data);
    auto* dst = static_cast<std::byte*>(out.data);
    const size_t n = in.nbytes();
    for (size_t off = 0; off < n || off == 0; off += slot_) {
      const size_t cnt = std::min(slot_, n - off);
      post_and_wait(src + off, cnt);
      for (int32_t m = 0; m < n_; ++m) std::memcpy(dst + static_cast<size_t>(m) * n + off, part(m).data(), cnt);
      if (n == 0) break;
    }
  }

  void reduce_scatter_sum(Backend& be, const Tensor& in, Tensor& out) override {
    if (in.device != DeviceKind::kCpu || out.device != DeviceKind::kCpu) {
      const Tensor h_in = to_host(be, in);
      Tensor h_out = host_f32_tensor(out.shape);
      reduce_scatter_sum(be, h_in, h_out);
      from_host(be, h_out, out);
      return;
    }
    const float* src = host_f32(in, "reduce_scatter_sum input");
    float* dst = host_f32(out, "reduce_scatter_sum output");
    BG_CHECK(in.numel() == out.numel() * n_, "shm reduce_scatter: {} values in, {} out for {} members", in.numel(),
             out.numel(), n_);
    const size_t block = static_cast<size_t>(out.numel()), per = slot_ / sizeof(float) / static_cast<size_t>(n_);
    BG_CHECK(per > 0, "shm reduce_scatter: slot of {} bytes is too small for {} members", slot_, n_);
    std::vector<float> staged;
    for (size_t off = 0; off < block || off == 0; off += per) {
      const size_t cnt = std::min(per, block - off);
      staged.resize(cnt * static_cast<size_t>(n_));
      for (int32_t m = 0; m < n_; ++m) {
        std::memcpy(staged.data() + static_cast<size_t>(m) * cnt, src + static_cast<size_t>(m) * block + off,
                    cnt * sizeof(float));
      }
      post_and_wait(reinterpret_cast<const std::byte*>(staged.data()), staged.size() * sizeof(float));
      for (size_t i = 0; i < cnt; ++i) {
        float acc = 0.0f;
        for (int32_t m = 0; m < n_; ++m) acc += reinterpret_cast<const float*>(part(m).data())[static_cast<size_t>(me_) * cnt + i];
        dst[off + i] = acc;
      }
      if (block == 0) break;
    }
  }

  void barrier() override { post_and_wait(nullptr, 0); }

  void all_reduce_max(std::span<int64_t> values) override {
    BG_CHECK(values.size_bytes() <= slot_, "shm all_reduce_max: {} values exceed the slot", values.size());
    post_and_wait(reinterpret_cast<const std::byte*>(values.data()), values.size_bytes());
    for (int32_t m = 0; m < n_; ++m) {
      const std::span<const std::byte> p = part(m);
      BG_CHECK(p.size() == values.size_bytes(), "shm all_reduce_max: member {} passed {} bytes, this one {}", m,
               p.size(), values.size_bytes());
      const auto* q = reinterpret_cast<const int64_t*>(p.data());
      for (size_t i = 0; i < values.size(); ++i) values[i] = std::max(values[i], q[i]);
    }
  }

  void broadcast(std::vector<std::byte>& bytes, int32_t root) override {
    BG_CHECK(root >= 0 && root < n_, "shm broadcast: root {} of {}", root, n_);
    uint64_t total = me_ == root ? bytes.size() : 0;
    std::vector<std::byte> first(sizeof(uint64_t));
    if (me_ == root) {
      std::memcpy(first.data(), &total, sizeof(total));
      first.insert(first.end(), bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(std::min<size_t>(
                                                                    bytes.size(), slot_ - sizeof(uint64_t))));
    }
    post_and_wait(me_ == root ? first.data() : nullptr, me_ == root ? first.size() : 0);
    std::span<const std::byte> p = part(root);
    std::memcpy(&total, p.data(), sizeof(total));
    std::vector<std::byte> out(p.begin() + sizeof(uint64_t), p.end());
    while (out.size() < total) {
      const size_t off = out.size(), cnt = std::min<size_t>(slot_, total - off);
      post_and_wait(me_ == root ? bytes.data() + off : nullptr, me_ == root ? cnt : 0);
      p = part(root);
      out.insert(out.end(), p.begin(), p.end());
    }
    bytes = std::move(out);
  }

  std::vector<std::vector<std::byte>> all_gather_bytes(std::span<const std::byte> bytes) override {
    int64_t size = static_cast<int64_t>(bytes.size());
    std::vector<int64_t> sizes(static_cast<size_t>(n_));
    post_and_wait(reinterpret_cast<const std::byte*>(&size), sizeof(size));
    int64_t longest = 0;
    for (int32_t m = 0; m < n_; ++m) {
      std::memcpy(&sizes[static_cast<size_t>(m)], part(m).data(), sizeof(int64_t));
      longest = std::max(longest, sizes[static_cast<size_t>(m)]);
    }
    std::vector<std::vector<std::byte>> out(static_cast<size_t>(n_));
    for (int64_t off = 0; off < longest; off += static_cast<int64_t>(slot_)) {
      const size_t cnt = static_cast<size_t>(std::clamp<int64_t>(size - off, 0, static_cast<int64_t>(slot_)));
      post_and_wait(bytes.data() + std::min<int64_t>(off, size), cnt);
      for (int32_t m = 0; m < n_; ++m) out[static_cast<size_t>(m)].insert(out[static_cast<size_t>(m)].end(),
                                                                        part(m).begin(), part(m).end());
    }
    return out;
  }

  void mark_failed(const std::string& reason) override { set_.mark_failed(first_rank_ + me_, reason); }

 private:
  SlotHeader* header(int32_t m) const {
    return reinterpret_cast<SlotHeader*>(base_ + static_cast<size_t>(m) * member_bytes(slot_));
  }
  std::byte* buffer(int32_t m, uint32_t round) const {
    return base_ + static_cast<size_t>(m) * member_bytes(slot_) + kSlotHeaderBytes + (round % 2) * slot_;
  }
  std::span<const std::byte> part(int32_t m) const {
    const uint64_t n = std::atomic_ref<uint64_t>(header(m)->size[round_ % 2]).load(std::memory_order_relaxed);
    return {buffer(m, round_), static_cast<size_t>(n)};
  }

  static Tensor host_f32_tensor(const Shape& shape) {
    auto buf = std::make_shared<std::vector<float>>(static_cast<size_t>(shape_numel(shape)));
    Tensor h;
    h.data = buf->data();
    h.owner = buf;
    h.dtype = DType::kF32;
    h.shape = shape;
    h.device = DeviceKind::kCpu;
    return h;
  }
  static Tensor to_host(Backend& be, const Tensor& t) {
    Tensor h = host_f32_tensor(t.shape);
    if (t.numel() > 0) be.download_f32(t, h.as<float>());
    return h;
  }
  static void from_host(Backend& be, const Tensor& h, Tensor& t) {
    if (t.numel() == 0) return;
    Tensor up = be.upload_f32({h.as<float>(), static_cast<size_t>(h.numel())}, t.shape, t.dtype);
    be.copy(up, t);
  }
  static float* host_f32(const Tensor& t, const char* what) {
    BG_CHECK(t.device == DeviceKind::kCpu && t.dtype == DType::kF32, "shm {}: needs an F32 CPU tensor, got {} on {}",
             what, dtype_name(t.dtype), t.device == DeviceKind::kCpu ? "cpu" : "cuda");
    return static_cast<float*>(t.data);
  }

  void post_and_wait(const std::byte* data, size_t n) {
    BG_CHECK(n <= slot_, "shm collective: {} bytes exceed the slot of {}", n, slot_);
    ++round_;
    SlotHeader* mine = header(me_);
    if (n > 0) std::memcpy(buffer(me_, round_), data, n);
    std::atomic_ref<uint64_t>(mine->size[round_ % 2]).store(n, std::memory_order_relaxed);
    store_and_wake(&mine->seq, round_);  // release: the data and size above are visible before the round number
    for (int32_t m = 0; m < n_; ++m) {
      if (m == me_) continue;
      const uint32_t* seq = &header(m)->seq;
      set_.wait(seq, [&] { return static_cast<int32_t>(load_acquire(seq) - round_) >= 0; }, "a collective");
    }
  }

  const ShmSet& set_;
  std::byte* base_;
  int32_t n_, me_, first_rank_;
  size_t slot_;
  uint32_t round_ = 0;
};

}  // namespace

size_t shm_comm_bytes(const ParallelLayout& layout, size_t slot_bytes) {
  // The world channel plus one channel per TP group (dp x tp = world members in all).
  return kControlBytes + 2 * static_cast<size_t>(layout.world()) * member_bytes(slot_bytes);
}

double rank_timeout_s(double fallback) {
  if (const char* env = std::getenv("BG_RANK_TIMEOUT_S")) {
    const double v = std::atof(env);
    if (v > 0.0) return v;
    log::warn("BG_RANK_TIMEOUT_S='{}' is not a positive number of seconds; using {}", env, fallback);
  }
  return fallback;
}

ShmRankSet::ShmRankSet(ShmSegment segment, const RankPlace& place, const ShmCommOptions& options)
    : segment_(std::move(segment)), place_(place), options_(options) {
  BG_CHECK(options_.slot_bytes >= 4096 && options_.slot_bytes % 64 == 0, "shm comm: slot of {} bytes",
           options_.slot_bytes);
  set_ = std::make_unique<ShmSet>(reinterpret_cast<ShmControl*>(segment_.data()), place_.layout.world(), place_.rank,
                                  rank_timeout_s(options_.timeout_s));
}

std::unique_ptr<ShmRankSet> ShmRankSet::create(const std::string& name, const RankPlace& place,
                                               const ShmCommOptions& options) {
  ShmSegment seg = ShmSegment::create(name, shm_comm_bytes(place.layout, options.slot_bytes));
  return std::unique_ptr<ShmRankSet>(new ShmRankSet(std::move(seg), place, options));
}

std::unique_ptr<ShmRankSet> ShmRankSet::open(const std::string& name, const RankPlace& place,
                                             const ShmCommOptions& options) {
  ShmSegment seg;
  try {
    seg = ShmSegment::open(name, shm_comm_bytes(place.layout, options.slot_bytes));
  } catch (const Error& e) {
    fail("{} (the ranks of a CPU rank set share memory, so they must run on one host with the same layout)",
         e.what());
  }
  return std::unique_ptr<ShmRankSet>(new ShmRankSet(std::move(seg), place, options));
}

void ShmRankSet::attach_and_wait() {
  set_->attach_and_wait();
  if (place_.rank == 0) segment_.unlink();  // every rank has it mapped: the name is no longer needed
}

std::unique_ptr<Comm> ShmRankSet::world_comm() const {
  std::byte* base = segment_.data() + kControlBytes;
  return std::make_unique<ShmChannelComm>(*set_, base, place_.layout.world(), place_.rank, 0, options_.slot_bytes);
}

std::unique_ptr<Comm> ShmRankSet::tp_comm() const {
  const ParallelLayout& l = place_.layout;
  const size_t per = member_bytes(options_.slot_bytes);
  std::byte* base = segment_.data() + kControlBytes + static_cast<size_t>(l.world()) * per +
                    static_cast<size_t>(place_.dp_group() * l.tp()) * per;
  return std::make_unique<ShmChannelComm>(*set_, base, l.tp(), place_.tp_rank(), l.leader_of(place_.dp_group()),
                                          options_.slot_bytes);
}

}  // namespace bg::dist
