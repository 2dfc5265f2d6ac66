// NcclComm (Comm over NCCL), the rank set's communicators and their bounded wait. Collectives on backend tensors
// first synchronize the backend (its stream is private to it), then run on the transport's stream and wait for it:
// correct on any backend stream, at the cost of a host round trip per collective (docs/PARALLEL.md, "CUDA ranks").
#include "dist/cuda/nccl_comm.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace bg::dist {
namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress) fail("NCCL {}: {}", what, ncclGetErrorString(r));
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA {}: {}", what, cudaGetErrorString(e));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    default: fail("NCCL collectives: dtype {} (bf16 or f32 only)", dtype_name(t));
  }
}

// A device staging buffer for host values (grows; owned by one comm).
class Staging {
 public:
  ~Staging() {
    if (p_ != nullptr) cudaFree(p_);
  }
  void* get(size_t bytes) {
    if (bytes > n_) {
      if (p_ != nullptr) cudaFree(p_);
      cuda_check(cudaMalloc(&p_, bytes), "staging alloc");
      n_ = bytes;
    }
    return p_;
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

class NcclComm final : public Comm {
 public:
  NcclComm(std::shared_ptr<NcclTransport> t, ncclComm_t comm, const char* label)
      : t_(std::move(t)), comm_(comm), label_(label) {
    nccl_check(ncclCommUserRank(comm_, &rank_), "rank");
    nccl_check(ncclCommCount(comm_, &size_), "count");
  }

  std::string_view transport() const override { return "nccl"; }
  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }

  void all_reduce_sum(Backend& be, Tensor& t) override {
    device_tensor(be, t, "all_reduce_sum");
    nccl_check(ncclAllReduce(t.data, t.data, static_cast<size_t>(t.numel()), nccl_type(t.dtype), ncclSum, comm_,
                             t_->stream), "all_reduce");
    t_->wait(comm_, "all_reduce_sum");
  }

  void all_gather(Backend& be, const Tensor& in, Tensor& out) override {
    device_tensor(be, in, "all_gather");
    BG_CHECK(out.numel() == in.numel() * size_ && out.dtype == in.dtype, "all_gather: out of {} values for {} x {}",
             out.numel(), size_, in.numel());
    nccl_check(ncclAllGather(in.data, out.data, static_cast<size_t>(in.numel()), nccl_type(in.dtype), comm_,
                             t_->stream), "all_gather");
    t_->wait(comm_, "all_gather");
  }

  void reduce_scatter_sum(Backend& be, const Tensor& in, Tensor& out) override {
    device_tensor(be, in, "reduce_scatter_sum");
    BG_CHECK(in.numel() == out.numel() * size_ && out.dtype == in.dtype, "reduce_scatter: in of {} values for {} x "
             "{}", in.numel(), size_, out.numel());
    nccl_check(ncclReduceScatter(in.data, out.data, static_cast<size_t>(out.numel()), nccl_type(in.dtype), ncclSum,
                                 comm_, t_->stream), "reduce_scatter");
    t_->wait(comm_, "reduce_scatter_sum");
  }

  void barrier() override {
    std::vector<int64_t> v{0};
    all_reduce_max(v);
  }

  void all_reduce_max(std::span<int64_t> values) override {
    if (values.empty()) return;
    const size_t bytes = values.size_bytes();
    void* d = staging_.get(bytes);
    cuda_check(cudaMemcpyAsync(d, values.data(), bytes, cudaMemcpyHostToDevice, t_->stream), "h2d");
    nccl_check(ncclAllReduce(d, d, values.size(), ncclInt64, ncclMax, comm_, t_->stream), "all_reduce max");
    cuda_check(cudaMemcpyAsync(values.data(), d, bytes, cudaMemcpyDeviceToHost, t_->stream), "d2h");
    t_->wait(comm_, "all_reduce_max");
  }

  void broadcast(std::vector<std::byte>& bytes, int32_t root) override {
    std::vector<int64_t> n{rank_ == root ? static_cast<int64_t>(bytes.size()) : 0};
    all_reduce_max(n);  // only the root's size is non-zero
    bytes.resize(static_cast<size_t>(n[0]));
    if (n[0] == 0) return;
    void* d = staging_.get(bytes.size());
    if (rank_ == root) {
      cuda_check(cudaMemcpyAsync(d, bytes.data(), bytes.size(), cudaMemcpyHostToDevice, t_->stream), "h2d");
    }
    nccl_check(ncclBroadcast(d, d, bytes.size(), ncclUint8, root, comm_, t_->stream), "broadcast");
    cuda_check(cudaMemcpyAsync(bytes.data(), d, bytes.size(), cudaMemcpyDeviceToHost, t_->stream), "d2h");
    t_->wait(comm_, "broadcast");
  }

  std::vector<std::vector<std::byte>> all_gather_bytes(std::span<const std::byte> bytes) override {
    // Sizes first (each member's in its own entry), then every payload padded to the largest.
    std::vector<int64_t> sizes(static_cast<size_t>(size_), 0);
    sizes[static_cast<size_t>(rank_)] = static_cast<int64_t>(bytes.size());
    all_reduce_max(sizes);
    int64_t most = 0;
    for (int64_t s : sizes) most = std::max(most, s);
    std::vector<std::vector<std::byte>> out(static_cast<size_t>(size_));
    if (most == 0) return out;
    const size_t per = static_cast<size_t>(most);
    auto* d = static_cast<std::byte*>(staging_.get(per * static_cast<size_t>(size_ + 1)));
    std::byte* mine = d + per * static_cast<size_t>(size_);
    cuda_check(cudaMemsetAsync(mine, 0, per, t_->stream), "memset");
    if (!bytes.empty()) {
      cuda_check(cudaMemcpyAsync(mine, bytes.data(), bytes.size(), cudaMemcpyHostToDevice, t_->stream), "h2d");
    }
    nccl_check(ncclAllGather(mine, d, per, ncclUint8, comm_, t_->stream), "all_gather bytes");
    std::vector<std::byte> all(per * static_cast<size_t>(size_));
    cuda_check(cudaMemcpyAsync(all.data(), d, all.size(), cudaMemcpyDeviceToHost, t_->stream), "d2h");
    t_->wait(comm_, "all_gather_bytes");
    for (int32_t r = 0; r < size_; ++r) {
      const auto* p = all.data() + per * static_cast<size_t>(r);
      out[static_cast<size_t>(r)].assign(p, p + sizes[static_cast<size_t>(r)]);
    }
    return out;
  }

  void mark_failed(const std::string& reason) override {
    // Aborting our communicators makes every peer's next collective fail or time out into RankFailure.
    log::error("rank set failed: {}; aborting the NCCL communicators", reason);
    t_->abort_all();
  }

 private:
  void device_tensor(Backend& be, const Tensor& t, const char* what) {
    BG_CHECK(t.device == DeviceKind::kCuda, "NCCL {}: the tensor is not in device memory", what);
    BG_CHECK(!t_->aborted, "NCCL {}: the communicators were aborted", what);
    be.synchronize();  // the tensor was written on the backend's stream
  }

  std::shared_ptr<NcclTransport> t_;
  ncclComm_t comm_;
  const char* label_;
  int rank_ = 0, size_ = 1;
  Staging staging_;
};

}  // namespace

NcclUniqueIdBytes nccl_unique_id() {
  ncclUniqueId id;
  nccl_check(ncclGetUniqueId(&id), "unique id");
  NcclUniqueIdBytes b{};
  std::memcpy(b.data(), id.internal, b.size());
  return b;
}

NcclTransport::~NcclTransport() {
  if (!aborted) {
    if (tp != nullptr && tp != world) ncclCommDestroy(tp);
    if (world != nullptr) ncclCommDestroy(world);
  }
  if (stream != nullptr) cudaStreamDestroy(stream);
}

void NcclTransport::abort_all() {
  if (aborted) return;
  aborted = true;
  if (tp != nullptr && tp != world) ncclCommAbort(tp);
  if (world != nullptr) ncclCommAbort(world);
}

void NcclTransport::wait(ncclComm_t comm, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  auto pause = std::chrono::microseconds(5);
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) fail("CUDA {}: {}", what, cudaGetErrorString(e));
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      abort_all();
      throw RankFailure(fmt::format("NCCL {}: {} (a peer rank failed)", what, ncclGetErrorString(async)));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      abort_all();
      throw RankFailure(fmt::format("NCCL {}: no answer from the other ranks within {:.0f} s", what, timeout_s));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

int select_rank_gpu(const RankPlace& place, bool shared) {
  int n_devices = 0;
  if (cudaGetDeviceCount(&n_devices) != cudaSuccess) n_devices = 0;
  BG_CHECK(n_devices > 0, "rank {}: --device cuda: no CUDA device is visible", place.rank);
  const int local = place.rank % place.layout.ranks_per_node();
  BG_CHECK(shared || place.layout.ranks_per_node() <= n_devices, "rank {}: {} CUDA ranks per host need {} GPUs, {} "
           "visible (NCCL does not put two ranks on one GPU; --k3-moe-exchange ll lets ranks share GPUs)", place.rank,
           place.layout.ranks_per_node(), place.layout.ranks_per_node(), n_devices);
  const int device = local % n_devices;
  cuda_check(cudaSetDevice(device), "set device");
  return device;
}

std::shared_ptr<RankContext> make_nccl_rank_context(const NcclUniqueIdBytes& id, const RankPlace& place,
                                                    double timeout_s) {
  auto t = std::make_shared<NcclTransport>();
  t->timeout_s = timeout_s;
  t->device = select_rank_gpu(place, false);
  cuda_check(cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking), "stream");
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), id.size());
  nccl_check(ncclCommInitRank(&t->world, place.layout.world(), uid, place.rank), "init (world)");
  if (place.layout.tp() == place.layout.world()) {
    t->tp = t->world;
  } else {
    nccl_check(ncclCommSplit(t->world, place.dp_group(), place.tp_rank(), &t->tp, nullptr), "split (TP group)");
  }
  auto ctx = std::make_shared<RankContext>();
  ctx->place = place;
  ctx->exchange = "nccl";
  ctx->world = std::make_unique<NcclComm>(t, t->world, "world");
  ctx->tp = std::make_unique<NcclComm>(t, t->tp, "tp");
  ctx->transport = t;
  log::info("rank {}: GPU {}, NCCL world of {}, TP group of {}", place.rank, t->device, place.layout.world(),
            place.layout.tp());
  return ctx;
}

NcclTransport& nccl_transport(const RankContext& ranks) {
  BG_CHECK(ranks.transport && ranks.world && ranks.world->transport() == "nccl",
           "rank {}: not an NCCL rank set", ranks.rank());
  return *static_cast<NcclTransport*>(ranks.transport.get());
}

}  // namespace bg::dist
