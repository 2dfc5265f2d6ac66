// ShmExchange: ll-layout dispatch/combine through shared memory, CPU backend (fp32 rows).
#include "moe/shm_exchange.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "ops/moe_exchange/moe_exchange.h"

namespace bg::moe {
namespace {

constexpr size_t kDoorbellBytes = 256;  // per rank region: a futex word senders bump after writing their flags

size_t align4k(size_t b) { return (b + 4095) / 4096 * 4096; }

class ShmExchange final : public Exchange {
 public:
  explicit ShmExchange(const ShmExchangeConfig& c) : c_(c) {
    BG_CHECK(c_.world && c_.set, "shm exchange: needs the world comm and the rank set");
    const ExpertPlacement& p = c_.placement;
    int64_t n_local = 0;
    for (int64_t r = 0; r < p.n_ranks(); ++r) n_local = std::max<int64_t>(n_local, p.experts_of(r).size());
    shape_ = {p.n_ranks(), n_local, 1, c_.top_k, c_.hidden, false, 4};
    shape_.max_tokens = c_.max_tokens > 0 ? c_.max_tokens : tokens_for_budget(c_.region_budget_bytes);
    layout_ = ops::ll_layout(shape_, 4);
    region_bytes_ = align4k(kDoorbellBytes + layout_.region_bytes);
    for (int64_t e = 0; e < p.n_experts(); ++e) {
      owner_.push_back(p.owner(e));
      slot_.push_back(p.slot(e));
    }
    n_local_here_ = p.n_local();
    open_segment();
  }

  std::string_view name() const override { return "shm"; }
  int64_t n_ranks() const override { return shape_.n_ranks; }
  int64_t rank() const override { return c_.placement.rank(); }
  int64_t max_tokens_per_call() const override { return shape_.max_tokens; }

  void begin_dispatch(Backend& be, const ExpertTable& table, const DispatchInput& in, ExpertRows& rows) override {
    BG_CHECK(in.ids && in.weights && in.x, "shm exchange: incomplete dispatch input");
    BG_CHECK(be.device() == DeviceKind::kCpu && be.act_dtype() == DType::kF32, "shm exchange: the CPU backend "
             "(fp32) only");
    BG_CHECK(table.n_slots() == n_local_here_ && table.n_experts() == static_cast<int64_t>(owner_.size()),
             "shm exchange: table of {} slots / {} experts, placement of {} / {}", table.n_slots(), table.n_experts(),
             n_local_here_, owner_.size());
    const int64_t n = in.x->rows();
    BG_CHECK(n == 0 || (in.x->cols() == shape_.hidden && in.ids->cols() == shape_.top_k), "shm exchange: rows of {} "
             "and top-{} for an exchange of {} and top-{}", in.x->cols(), in.ids->cols(), shape_.hidden, shape_.top_k);
    ++epoch_;
    ids_ = *in.ids;
    weights_ = *in.weights;
    n_tokens_ = n;
    const ops::LlPlacement place{owner_.data(), slot_.data(), static_cast<int64_t>(owner_.size())};
    ops::ll_dispatch_send_cpu(shape_, layout_, place, epoch_, n > 0 ? ids_.as<int32_t>() : nullptr,
                              n > 0 ? in.x->as<float>() : nullptr, n, peers());
    ring_all();
    const int64_t capacity = ops::ll_recv_capacity(shape_);
    const ops::MoeRoutingShape recv{shape_.n_ranks * shape_.max_tokens, std::min(shape_.top_k, shape_.n_local),
                                    static_cast<int64_t>(owner_.size()), n_local_here_, false};
    rows.routing = be.moe_routing(recv);
    rows.x = be.act(capacity, shape_.hidden);
    rows.y = be.act(capacity, shape_.hidden);
    rows.origin = be.alloc({capacity}, DType::kI32);
  }

  void finish_dispatch(Backend&, ExpertRows& rows) override {
    const int parity = static_cast<int>(epoch_ & 1u);
    std::byte* mine = region(rank());
    c_.set->wait(doorbell(rank()), [&] {
      for (int64_t s = 0; s < n_local_here_; ++s) {
        for (int64_t src = 0; src < shape_.n_ranks; ++src) {
          const auto* f = reinterpret_cast<const uint32_t*>(mine + layout_.dispatch_flag_offset(parity, s, src, shape_));
          if (!ops::ll_flag_cpu_is(dist::load_acquire(f), epoch_)) return false;
        }
      }
      return true;
    }, "expert rows (dispatch)");
    const ops::MoeRoutingArrays r = ops::moe_routing_layout(rows.routing.shape, rows.routing.buffer.data);
    ops::ll_dispatch_unpack_cpu(shape_, layout_, epoch_, mine, n_local_here_, r, rows.x.as<float>(),
                                rows.origin.as<int32_t>());
  }

  void begin_combine(Backend&, const ExpertRows& rows, Tensor&) override {
    const ops::MoeRoutingArrays r = ops::moe_routing_layout(rows.routing.shape, rows.routing.buffer.data);
    ops::ll_combine_send_cpu(shape_, layout_, epoch_, r, n_local_here_, rows.y.as<float>(),
                             rows.origin.as<int32_t>(), peers());
    ring_all();
  }

  void finish_combine(Backend&, Tensor& out) override {
    const int parity = static_cast<int>(epoch_ & 1u);
    std::byte* mine = region(rank());
    c_.set->wait(doorbell(rank()), [&] {
      for (int64_t src = 0; src < shape_.n_ranks; ++src) {
        const auto* f = reinterpret_cast<const uint32_t*>(mine + layout_.combine_flag_offset(parity, src));
        if (!ops::ll_flag_cpu_is(dist::load_acquire(f), epoch_)) return false;
      }
      return true;
    }, "expert outputs (combine)");
    if (n_tokens_ == 0) return;
    BG_CHECK(out.rows() == n_tokens_ && out.cols() == shape_.hidden, "shm exchange: combine into [{}, {}] for {} "
             "tokens of {}", out.rows(), out.cols(), n_tokens_, shape_.hidden);
    ops::ll_combine_reduce_cpu(shape_, layout_, epoch_, mine, ids_.as<int32_t>(), weights_.as<float>(), n_tokens_,
                               out.as<float>());
  }

 private:
  int64_t tokens_for_budget(int64_t budget) const {
    const int64_t row = shape_.hidden * 4 + ops::kLlMsgHeaderBytes;
    const int64_t per_token = 2 * (shape_.n_local * shape_.n_ranks * row + shape_.top_k * shape_.hidden * 4);
    return std::clamp<int64_t>(budget / std::max<int64_t>(per_token, 1), 1, 64);
  }

  void open_segment() {
    const size_t bytes = region_bytes_ * static_cast<size_t>(shape_.n_ranks);
    std::vector<std::byte> name;
    if (c_.world->rank() == 0) {
      segment_ = dist::ShmSegment::create(dist::unique_shm_name("moe"), bytes);
      name.assign(reinterpret_cast<const std::byte*>(segment_.name().data()),
                  reinterpret_cast<const std::byte*>(segment_.name().data()) + segment_.name().size());
    }
    c_.world->broadcast(name, 0);
    if (c_.world->rank() != 0) {
      segment_ = dist::ShmSegment::open(std::string(reinterpret_cast<const char*>(name.data()), name.size()), bytes);
    }
    c_.world->barrier();  // every rank has it mapped
    if (c_.world->rank() == 0) segment_.unlink();
    for (int64_t r = 0; r < shape_.n_ranks; ++r) regions_.push_back(region(r));
    log::info("shm exchange: {} ranks x {} slots, {} tokens per call, {:.1f} MiB per rank", shape_.n_ranks,
              shape_.n_local, shape_.max_tokens, static_cast<double>(region_bytes_) / (1 << 20));
  }

  std::byte* region(int64_t r) const {
    return segment_.data() + static_cast<size_t>(r) * region_bytes_ + kDoorbellBytes;
  }
  uint32_t* doorbell(int64_t r) const {
    return reinterpret_cast<uint32_t*>(segment_.data() + static_cast<size_t>(r) * region_bytes_);
  }
  ops::LlPeers peers() const { return {regions_, rank()}; }
  // Wakes every rank: its flags from this rank are written (futex word, release).
  void ring_all() const {
    for (int64_t r = 0; r < shape_.n_ranks; ++r) dist::bump_and_wake(doorbell(r));
  }

  ShmExchangeConfig c_;
  ops::LlShape shape_;
  ops::LlLayout layout_;
  size_t region_bytes_ = 0;
  std::vector<int32_t> owner_, slot_;
  int64_t n_local_here_ = 0;
  dist::ShmSegment segment_;
  std::vector<std::byte*> regions_;
  uint32_t epoch_ = 0;
  Tensor ids_, weights_;
  int64_t n_tokens_ = 0;
};

}  // namespace

std::unique_ptr<Exchange> make_shm_exchange(const ShmExchangeConfig& config) {
  return std::make_unique<ShmExchange>(config);
}

}  // namespace bg::moe
