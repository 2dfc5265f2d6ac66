// The single-rank exchange: routing and gather into slot order on the backend, combine back to token order.
#include "core/error.h"
#include "moe/exchange.h"

namespace bg::moe {
namespace {

class LoopbackExchange final : public Exchange {
 public:
  std::string_view name() const override { return "loopback"; }
  int64_t n_ranks() const override { return 1; }
  int64_t rank() const override { return 0; }
  bool local() const override { return true; }

  void begin_dispatch(Backend& be, const ExpertTable& table, const DispatchInput& in, ExpertRows& rows) override {
    BG_CHECK(in.ids && in.weights && in.x, "loopback exchange: incomplete dispatch input");
    BG_CHECK(in.ids->shape.size() == 2 && in.x->shape.size() == 2, "loopback exchange: ids and x must be 2-D");
    // From the shapes, not cols(): an empty batch ([0, top_k]) has cols() 0, which the routing shape refuses.
    const int64_t n = in.x->rows(), hidden = in.x->shape[1], top_k = in.ids->shape[1];
    ops::MoeRoutingShape shape{n, top_k, table.n_experts(), table.n_slots(), /*all_local=*/true};
    rows.routing = be.moe_routing(shape);
    be.moe_dispatch(table.slot_map(), *in.ids, *in.weights, rows.routing, -1);
    rows.x = be.act(shape.n_pairs(), hidden);  // [n_pairs, hidden]: every pair is local
    rows.y = be.act(shape.n_pairs(), hidden);
    be.moe_gather(rows.routing, *in.x, rows.x);
  }
  void finish_dispatch(Backend&, ExpertRows&) override {}
  void begin_combine(Backend& be, const ExpertRows& rows, Tensor& out) override {
    be.moe_combine(rows.routing, rows.y, out);
  }
  void finish_combine(Backend&, Tensor&) override {}
};

}  // namespace

std::unique_ptr<Exchange> make_loopback_exchange() { return std::make_unique<LoopbackExchange>(); }

}  // namespace bg::moe
