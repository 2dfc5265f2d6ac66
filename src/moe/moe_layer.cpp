// The MoE layer: route -> dispatch -> experts -> combine.
#include "moe/moe_layer.h"

#include <algorithm>

#include "core/error.h"

namespace bg::moe {
namespace {

// Streamed experts: the routing's rows per slot on the host (one small device -> host copy and a wait), then the
// slots with rows made to hold their experts.
void stage_experts(Backend& be, ExpertTable& table, const MoeRouting& r) {
  if (!table.streams()) return;
  const ops::MoeRoutingArrays at = ops::moe_routing_layout(r.shape, r.buffer.data);  // addresses only, not read
  const auto offset = reinterpret_cast<uintptr_t>(at.counts) - reinterpret_cast<uintptr_t>(r.buffer.data);
  std::vector<int32_t> rows(static_cast<size_t>(r.shape.n_slots));
  const HostCopy copy{r.buffer, static_cast<size_t>(offset),
                      reinterpret_cast<std::byte*>(rows.data()), rows.size() * sizeof(int32_t)};
  be.wait_fence(be.copy_to_host({&copy, 1}));
  table.stage(be, rows);
}

}  // namespace

MoeChoice moe_route(Backend& be, const MoeLayerSpec& spec, const MoeLayerWeights& w, const Tensor& x,
                    int64_t step_row0) {
  const int64_t n = x.rows(), E = spec.router.n_experts, k = spec.router.top_k;
  if (n == 0) return {be.alloc({0, k}, DType::kI32), be.alloc({0, k}, DType::kF32), step_row0};  // no tokens here
  Tensor logits = be.alloc({n, E}, DType::kF32);  // [n, E] fp32: routing decisions need the full precision
  be.linear(*w.router, x, logits);
  MoeChoice c{be.alloc({n, k}, DType::kI32), be.alloc({n, k}, DType::kF32), step_row0};  // [n, k]
  ops::RouterParams p = spec.router;
  p.n_tokens = n;
  be.route(p, logits, w.router_bias, c.ids, c.weights);
  return c;
}

void moe_routed(Backend& be, Exchange& exchange, const MoeLayerSpec& spec, MoeLayerWeights& w,
                const MoeChoice& choice, const Tensor& x_expert, Tensor& out, const std::function<void()>& overlap,
                bool accumulate) {
  if (exchange.local()) {  // one rank: no rows move; gather, experts and combine as one (fusable) backend op
    BG_CHECK(choice.ids.shape.size() == 2, "moe_routed: ids must be [tokens, top_k]");
    // top_k from the shape: cols() is 0 for an empty batch, which the routing shape refuses.
    const ops::MoeRoutingShape shape{x_expert.rows(), choice.ids.shape[1], w.experts.n_experts(), w.experts.n_slots(),
                                     /*all_local=*/true};
    MoeRouting routing = be.moe_routing(shape);
    be.moe_dispatch(w.experts.slot_map(), choice.ids, choice.weights, routing, choice.step_row0);
    stage_experts(be, w.experts, routing);
    if (overlap) overlap();
    be.moe_routed_local(w.experts.slots(), spec.glu, routing, x_expert, out, accumulate);
    return;
  }
  if (!accumulate) be.fill_zero(out);  // the exchanges' combines add to `out`
  // Rounds of at most `per` tokens (exchanges with fixed receive slots); every rank runs step_rounds() of them, with
  // empty rounds once its own tokens are done, so the ranks meet in every dispatch and combine.
  const int64_t n = x_expert.rows(), per = exchange.max_tokens_per_call();
  const int64_t rounds = exchange.step_rounds();
  BG_CHECK(per == 0 || n <= rounds * per, "moe: {} tokens on this rank but the step was agreed for at most {}", n,
           rounds * per);
  for (int64_t r = 0; r < rounds; ++r) {
    const int64_t lo = per == 0 ? 0 : std::min(n, r * per), cnt = per == 0 ? n : std::min(per, n - lo);
    const Tensor ids = choice.ids.rows_view(lo, cnt), wts = choice.weights.rows_view(lo, cnt);
    const Tensor x = x_expert.rows_view(lo, cnt);
    Tensor o = out.rows_view(lo, cnt);
    ExpertRows rows;
    exchange.begin_dispatch(be, w.experts, {&ids, &wts, &x}, rows);
    if (r == 0 && overlap) overlap();
    exchange.finish_dispatch(be, rows);
    stage_experts(be, w.experts, rows.routing);
    be.moe_experts(w.experts.slots(), spec.glu, rows.routing, rows.x, rows.y);  // [rows, hidden]
    exchange.begin_combine(be, rows, o);
    exchange.finish_combine(be, o);
  }
}

}  // namespace bg::moe
