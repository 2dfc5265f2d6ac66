// The MoE layer: route -> dispatch -> experts -> combine.
#include "moe/moe_layer.h"

namespace bg::moe {

MoeChoice moe_route(Backend& be, const MoeLayerSpec& spec, const MoeLayerWeights& w, const Tensor& x) {
  const int64_t n = x.rows(), E = spec.router.n_experts, k = spec.router.top_k;
  Tensor logits = be.alloc({n, E}, DType::kF32);  // [n, E] fp32: routing decisions need the full precision
  be.linear(*w.router, x, logits);
  MoeChoice c{be.alloc({n, k}, DType::kI32), be.alloc({n, k}, DType::kF32)};  // [n, k]
  ops::RouterParams p = spec.router;
  p.n_tokens = n;
  be.route(p, logits, w.router_bias, c.ids, c.weights);
  return c;
}

void moe_routed(Backend& be, Exchange& exchange, const MoeLayerSpec& spec, const MoeLayerWeights& w,
                const MoeChoice& choice, const Tensor& x_expert, Tensor& out, const std::function<void()>& overlap) {
  if (exchange.local()) {  // one rank: no rows move; gather, experts and combine as one (fusable) backend op
    const ops::MoeRoutingShape shape{x_expert.rows(), choice.ids.cols(), w.experts.n_experts(), w.experts.n_slots(),
                                     /*all_local=*/true};
    MoeRouting routing = be.moe_routing(shape);
    be.moe_dispatch(w.experts.slot_map(), choice.ids, choice.weights, routing);
    if (overlap) overlap();
    be.moe_routed_local(w.experts.slots(), spec.glu, routing, x_expert, out);
    return;
  }
  ExpertRows rows;
  exchange.begin_dispatch(be, w.experts, {&choice.ids, &choice.weights, &x_expert}, rows);
  if (overlap) overlap();
  exchange.finish_dispatch(be, rows);
  be.moe_experts(w.experts.slots(), spec.glu, rows.routing, rows.x, rows.y);  // [rows, hidden]
  exchange.begin_combine(be, rows, out);
  exchange.finish_combine(be, out);
}

}  // namespace bg::moe
