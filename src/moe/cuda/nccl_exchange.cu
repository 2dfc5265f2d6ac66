// NcclExchange: the expert exchange between CUDA ranks as an all-to-all of variable-size bf16 row batches. Dispatch:
// the pairs' destinations are bucketed on the host (ids come down once per call), rows are gathered into destination
// order, the per-peer counts go first (one int64 per peer), then grouped ncclSend/ncclRecv move the rows and their
// global expert ids. The receiver groups the rows by local slot with the backend's own dispatch/gather (top-1,
// weight 1), so the experts run exactly as on one rank. Combine returns each row to its sender in the same order and
// reduces out[t] += sum_k w(t,k) y(t,k) in k order in fp32 -- the loopback's arithmetic, so results match it bit for
// bit. The host round trips make this the prefill / large-batch path; it is not CUDA-graph capturable.
#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "dist/cuda/nccl_comm.h"
#include "moe/cuda_exchange.h"

namespace bg::moe {
namespace {

constexpr int kThreads = 128;

// grid n_send: out[i] = x[pair[i] / top_k]  (rows of hidden bf16)
__global__ void __launch_bounds__(kThreads) gather_rows_kernel(const __nv_bfloat16* x, const int32_t* pair,
                                                               int top_k, int64_t hidden, __nv_bfloat16* out) {
  const int64_t i = blockIdx.x, t = pair[i] / top_k;
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) out[i * hidden + j] = x[t * hidden + j];
}

// grid n_tokens: out[t] = bf16(out[t] + sum_k w[t,k] * ret[pair_row[t,k]]) with fmaf in k order (as moe_combine);
// pair_row -1 is a pair without an expert (id < 0).
__global__ void __launch_bounds__(kThreads) combine_pairs_kernel(const int32_t* pair_row, const float* w,
                                                                 const __nv_bfloat16* ret, int top_k, int64_t hidden,
                                                                 __nv_bfloat16* out) {
  const int64_t t = blockIdx.x;
  for (int64_t j = threadIdx.x; j < hidden; j += kThreads) {
    float acc = __bfloat162float(out[t * hidden + j]);
    for (int k = 0; k < top_k; ++k) {
      const int32_t row = pair_row[t * top_k + k];
      if (row < 0) continue;
      acc = fmaf(w[t * top_k + k], __bfloat162float(ret[static_cast<int64_t>(row) * hidden + j]), acc);
    }
    out[t * hidden + j] = __float2bfloat16(acc);
  }
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("nccl exchange: CUDA {}: {}", what, cudaGetErrorString(e));
}
void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress) fail("nccl exchange: NCCL {}: {}", what, ncclGetErrorString(r));
}

class NcclExchange final : public Exchange {
 public:
  NcclExchange(Backend& be, const CudaExchangeConfig& c)
      : c_(c), t_(dist::nccl_transport(*c.ranks)), world_(c.ranks->world_size()) {
    BG_CHECK(be.device() == DeviceKind::kCuda && be.act_dtype() == DType::kBF16, "nccl exchange: needs the CUDA "
             "backend (got {})", be.name());
    BG_CHECK(c_.placement.n_ranks() == world_, "nccl exchange: a placement over {} ranks in a world of {}",
             c_.placement.n_ranks(), world_);
    for (int64_t e = 0; e < c_.placement.n_experts(); ++e) owner_.push_back(c_.placement.owner(e));
    log::info("nccl exchange: rank {} of {}, {} experts here, hidden {}, top-{}", rank(), world_,
              c_.placement.n_local(), c_.hidden, c_.top_k);
  }

  std::string_view name() const override { return "nccl"; }
  int64_t n_ranks() const override { return world_; }
  int64_t rank() const override { return c_.placement.rank(); }
  int64_t max_tokens_per_call() const override { return c_.max_tokens; }

  void begin_dispatch(Backend& be, const ExpertTable& table, const DispatchInput& in, ExpertRows& rows) override {
    BG_CHECK(in.ids && in.weights && in.x, "nccl exchange: incomplete dispatch input");
    n_tokens_ = in.x->rows();
    top_k_ = n_tokens_ == 0 ? c_.top_k : in.ids->cols();
    BG_CHECK(n_tokens_ == 0 || (in.x->cols() == c_.hidden && top_k_ == c_.top_k), "nccl exchange: rows of {} and "
             "top-{} for an exchange of {} and top-{}", in.x->cols(), top_k_, c_.hidden, c_.top_k);
    weights_ = *in.weights;
    be.synchronize();  // ids and x were written on the backend's stream
    bucket_pairs(be, *in.ids);
    send_x_ = be.act(n_send_, c_.hidden);
    if (n_send_ > 0) {
      gather_rows_kernel<<<static_cast<unsigned>(n_send_), kThreads, 0, t_.stream>>>(
          in.x->as<__nv_bfloat16>(), send_pair_.as<int32_t>(), static_cast<int>(top_k_), c_.hidden,
          send_x_.as<__nv_bfloat16>());
      cuda_check(cudaGetLastError(), "gather launch");
    }
    exchange_counts(be);
    recv_x_ = be.act(n_recv_, c_.hidden);
    Tensor recv_ids = be.alloc({n_recv_, 1}, DType::kI32);
    nccl_check(ncclGroupStart(), "group start");
    for (int64_t p = 0; p < world_; ++p) {
      move_rows(send_x_, send_off_[p], send_cnt_[p], p, true);
      move_ids(send_expert_, send_off_[p], send_cnt_[p], p, true);
      move_rows(recv_x_, recv_off_[p], recv_cnt_[p], p, false);
      move_ids(recv_ids, recv_off_[p], recv_cnt_[p], p, false);
    }
    nccl_check(ncclGroupEnd(), "group end");
    t_.wait(t_.world, "expert exchange (dispatch)");
    // Group the received rows by local slot: top-1 routing with weight 1 (every received expert must be here).
    const ops::MoeRoutingShape shape{n_recv_, 1, table.n_experts(), table.n_slots(), /*all_local=*/true};
    const Tensor ones = be.upload_f32(std::vector<float>(static_cast<size_t>(n_recv_), 1.0f), {n_recv_, 1},
                                      DType::kF32);
    rows.routing = be.moe_routing(shape);
    be.moe_dispatch(table.slot_map(), recv_ids, ones, rows.routing, -1);
    rows.x = be.act(n_recv_, c_.hidden);
    rows.y = be.act(n_recv_, c_.hidden);
    be.moe_gather(rows.routing, recv_x_, rows.x);
  }

  void finish_dispatch(Backend&, ExpertRows&) override {}

  void begin_combine(Backend& be, const ExpertRows& rows, Tensor&) override {
    // Back to arrival order (top-1, weight 1: bf16(0 + 1 * y) = y exactly), then to the senders in their send order.
    Tensor back = be.act(n_recv_, c_.hidden);
    be.fill_zero(back);
    be.moe_combine(rows.routing, rows.y, back);
    be.synchronize();
    ret_ = be.act(n_send_, c_.hidden);
    nccl_check(ncclGroupStart(), "group start");
    for (int64_t p = 0; p < world_; ++p) {
      move_rows(back, recv_off_[p], recv_cnt_[p], p, true);
      move_rows(ret_, send_off_[p], send_cnt_[p], p, false);
    }
    nccl_check(ncclGroupEnd(), "group end");
    t_.wait(t_.world, "expert exchange (combine)");
  }

  void finish_combine(Backend& be, Tensor& out) override {
    if (n_tokens_ == 0) return;
    BG_CHECK(out.rows() == n_tokens_ && out.cols() == c_.hidden && out.dtype == DType::kBF16, "nccl exchange: "
             "combine into [{}, {}] for {} tokens of {}", out.rows(), out.cols(), n_tokens_, c_.hidden);
    be.synchronize();  // `out` may have been written on the backend's stream since dispatch
    combine_pairs_kernel<<<static_cast<unsigned>(n_tokens_), kThreads, 0, t_.stream>>>(
        pair_row_.as<int32_t>(), weights_.as<float>(), ret_.as<__nv_bfloat16>(), static_cast<int>(top_k_),
        c_.hidden, out.as<__nv_bfloat16>());
    cuda_check(cudaGetLastError(), "combine launch");
    t_.wait(t_.world, "expert exchange (reduce)");
  }

 private:
  // Host: destination of every pair, send order (by destination, then pair order), counts and offsets.
  void bucket_pairs(Backend& be, const Tensor& ids_dev) {
    const int64_t n_pairs = n_tokens_ * top_k_;
    std::vector<int32_t> ids(static_cast<size_t>(n_pairs));
    if (n_pairs > 0) cuda_check(cudaMemcpy(ids.data(), ids_dev.data, ids.size() * 4, cudaMemcpyDeviceToHost), "ids");
    send_cnt_.assign(static_cast<size_t>(world_), 0);
    for (int32_t id : ids) {
      if (id < 0) continue;
      BG_CHECK(id < static_cast<int32_t>(owner_.size()), "nccl exchange: expert id {} of {}", id, owner_.size());
      ++send_cnt_[static_cast<size_t>(owner_[static_cast<size_t>(id)])];
    }
    send_off_ = offsets(send_cnt_);
    n_send_ = send_off_.back();
    std::vector<int64_t> cursor(send_off_.begin(), send_off_.end() - 1);
    std::vector<int32_t> pair(static_cast<size_t>(n_send_)), expert(static_cast<size_t>(n_send_));
    std::vector<int32_t> pair_row(static_cast<size_t>(n_pairs), -1);
    for (int64_t p = 0; p < n_pairs; ++p) {
      const int32_t id = ids[static_cast<size_t>(p)];
      if (id < 0) continue;
      const int64_t i = cursor[static_cast<size_t>(owner_[static_cast<size_t>(id)])]++;
      pair[static_cast<size_t>(i)] = static_cast<int32_t>(p);
      expert[static_cast<size_t>(i)] = id;
      pair_row[static_cast<size_t>(p)] = static_cast<int32_t>(i);
    }
    send_pair_ = upload_i32(be, pair);
    send_expert_ = upload_i32(be, expert);
    pair_row_ = upload_i32(be, pair_row);
  }

  // Counts first: one int64 to and from every peer (self included), then the receive offsets on the host.
  void exchange_counts(Backend& be) {
    Tensor cnt = be.alloc({2 * world_}, DType::kI64);
    std::vector<int64_t> host(static_cast<size_t>(2 * world_), 0);
    std::copy(send_cnt_.begin(), send_cnt_.end(), host.begin());
    cuda_check(cudaMemcpy(cnt.data, host.data(), host.size() * 8, cudaMemcpyHostToDevice), "counts");
    auto* d = cnt.as<int64_t>();
    nccl_check(ncclGroupStart(), "group start");
    for (int64_t p = 0; p < world_; ++p) {
      nccl_check(ncclSend(d + p, 1, ncclInt64, static_cast<int>(p), t_.world, t_.stream), "send counts");
      nccl_check(ncclRecv(d + world_ + p, 1, ncclInt64, static_cast<int>(p), t_.world, t_.stream), "recv counts");
    }
    nccl_check(ncclGroupEnd(), "group end");
    t_.wait(t_.world, "expert exchange (counts)");
    cuda_check(cudaMemcpy(host.data(), d, host.size() * 8, cudaMemcpyDeviceToHost), "counts");
    recv_cnt_.assign(host.begin() + world_, host.end());
    for (int64_t c : recv_cnt_) BG_CHECK(c >= 0, "nccl exchange: a peer announced {} rows", c);
    recv_off_ = offsets(recv_cnt_);
    n_recv_ = recv_off_.back();
  }

  void move_rows(const Tensor& rows, int64_t off, int64_t cnt, int64_t peer, bool send) {
    if (cnt == 0) return;
    auto* p = rows.as<__nv_bfloat16>() + off * c_.hidden;
    const size_t n = static_cast<size_t>(cnt * c_.hidden);
    nccl_check(send ? ncclSend(p, n, ncclBfloat16, static_cast<int>(peer), t_.world, t_.stream)
                    : ncclRecv(p, n, ncclBfloat16, static_cast<int>(peer), t_.world, t_.stream), "rows");
  }
  void move_ids(const Tensor& ids, int64_t off, int64_t cnt, int64_t peer, bool send) {
    if (cnt == 0) return;
    auto* p = ids.as<int32_t>() + off;
    const size_t n = static_cast<size_t>(cnt);
    nccl_check(send ? ncclSend(p, n, ncclInt32, static_cast<int>(peer), t_.world, t_.stream)
                    : ncclRecv(p, n, ncclInt32, static_cast<int>(peer), t_.world, t_.stream), "expert ids");
  }

  static std::vector<int64_t> offsets(const std::vector<int64_t>& counts) {
    std::vector<int64_t> off(counts.size() + 1, 0);
    for (size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
    return off;
  }
  static Tensor upload_i32(Backend& be, const std::vector<int32_t>& v) {
    Tensor t = be.alloc({static_cast<int64_t>(v.size())}, DType::kI32);
    if (!v.empty()) cuda_check(cudaMemcpy(t.data, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "upload");
    return t;
  }

  CudaExchangeConfig c_;
  dist::NcclTransport& t_;
  int64_t world_ = 1;
  std::vector<int32_t> owner_;
  int64_t n_tokens_ = 0, top_k_ = 0, n_send_ = 0, n_recv_ = 0;
  std::vector<int64_t> send_cnt_, send_off_, recv_cnt_, recv_off_;
  Tensor weights_, send_pair_, send_expert_, pair_row_, send_x_, recv_x_, ret_;
};

}  // namespace

std::unique_ptr<Exchange> make_nccl_exchange(Backend& be, const CudaExchangeConfig& config) {
  BG_CHECK(config.ranks != nullptr, "nccl exchange: no rank context");
  return std::make_unique<NcclExchange>(be, config);
}

}  // namespace bg::moe
