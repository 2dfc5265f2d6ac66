// Kernel cases of the routed-expert path at the K3 EP16 rank's shapes: 56 local MXFP4 experts (gate / up [3072 x
// 3584], down [3584 x 3072], SiTU), top-16 routing of each token, the router over K3's 896 global experts.
//   router_topk         the top-16 of 896 router (fp32 logits -> ids, weights), the default algorithm (a sort of keys)
//   router_topk_rounds  the same taking the top-k in k rounds of a block argmax (ops::RouterTopk::kRounds)
//   moe_decode_w4a16    the fused W4A16 kernel (gate/up + GLU, down + weighted combine; dispatch done in setup) over
//                       the load-time layout, what Backend::moe_routed_local runs at decode (ops/moe_w4a16)
//   moe_decode_w4a16_wgmma the same on wgmma (MoeW4a16Params::wgmma; off by default: slower below 32 rows)
//   moe_decode_w4a16_wide the same without the two-CTAs-per-SM shape that the default takes up to 16 tokens
//                       (MoeW4a16Params::narrow = false)
//   moe_decode_w4a16_rows  the same kernel with rows in / rows out (gather in setup, no combine): what an
//                       expert-parallel rank runs on the rows the exchange delivered (Backend::moe_experts)
//   moe_decode_stages   the stage kernels' expert FFN alone (dispatch and gather done in setup), decode batches
//   moe_decode_routed   dispatch + gather + stage FFN + combine (the path when the fused kernel is not preferred)
//   moe_prefill_tiled   the tiled stage kernel (weights dequantized per tile in shared memory) at prefill token counts
//   moe_prefill_grouped the dequantize-once path at prefill token counts: dequant of the touched experts into the bf16
//                       scratch + cuBLAS grouped GEMMs + GLU (ops/moe/moe_grouped_cuda.h), dequant included; its
//                       fraction is of the same run's bf16 grouped GEMM ceiling at the nearest rows per expert
//   moe_prefill_grouped_per_expert  the same with one cublasGemmEx per expert instead of the grouped call
//   moe_prefill_grouped_dequant  the dequant pass of that path alone (bytes: packed in, bf16 out)
//   moe_prefill_w4a16   the W4A16 prefill kernel (ops/moe_w4a16/moe_w4a16_prefill_cuda.h: the weights decoded in
//                       registers, the gather fused, rows out; no combine), the default at 32..511 rows per expert; fraction
//                       of the same bf16 grouped GEMM ceiling
//   moe_prefill_fp8     the FP8 path (BG_MOE_PREFILL=fp8, ops/moe/moe_fp8_cuda.h: x quantized to E4M3 per 128
//                       inputs, the touched experts converted from the W4A16 layout to E4M3, cuBLASLt block-scaled FP8
//                       GEMMs per expert, the GLU quantizing h), conversion included; fraction of the same bf16
//                       grouped GEMM ceiling (the target for it: 1.4)
//   moe_prefill_fp8_convert  the conversion pass of that path alone (bytes: packed in, E4M3 + scales out)
//   moe_dispatch_prefill the device-side dispatch alone at a long prefill step
//   moe_crossover_decode_kernel / moe_crossover_prefill_kernel  the fused decode kernel (with its combine) and the
//                       W4A16 prefill kernel + the combine at 64..1024 tokens: where the prefill kernel starts to win
//                       (sets ops::kMoeW4a16PrefillMinRows)
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/log.h"
#include "bench/cuda/kernel_case.h"
#include "ops/moe/moe_cuda.h"
#include "ops/moe/moe_fp8_cuda.h"
#include "ops/moe/moe_grouped_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"
#include "ops/moe_w4a16/moe_w4a16_prefill_cuda.h"
#include "ops/router/router_cuda.h"

namespace bg::bench::cuda {
namespace {

using ops::ExpertWeightsCuda;
using ops::MoeCudaParams;
using ops::MoeDispatchBuffers;
using ops::MoeOutType;

using bf16 = __nv_bfloat16;

constexpr int64_t kExperts = 56, kTopK = 16, kLatent = 3584, kInter = 3072;

double d(int64_t v) { return static_cast<double>(v); }
size_t z(int64_t v) { return static_cast<size_t>(v); }

// Stored bytes of one MXFP4 [out, in] weight: codes (4 bits) + one E8M0 scale per 32 inputs.
double mxfp4_bytes(int64_t out, int64_t in) { return d(out * in) / 2 + d(out * in / 32); }
double expert_bytes() { return 2 * mxfp4_bytes(kInter, kLatent) + mxfp4_bytes(kLatent, kInter); }
double expert_params() { return 3 * d(kInter * kLatent); }

// The 56 experts with random MXFP4 codes and realistic scales, as the device array the FFN launcher takes.
const ExpertWeightsCuda* make_experts(CaseMemory& mem) {
  auto weight = [&](int64_t out, int64_t in) {
    return ops::DeviceWeight{WeightFormat::kMxfp4, out, in, mem.bytes(z(out * in / 2)), mem.e8m0(z(out * in / 32))};
  };
  std::vector<ExpertWeightsCuda> experts;
  for (int64_t e = 0; e < kExperts; ++e) {
    experts.push_back({weight(kInter, kLatent), weight(kInter, kLatent), weight(kLatent, kInter)});
  }
  return mem.upload(experts);
}

// Top-16 of 56 distinct experts per token (uniformly random, as a balanced router gives) and weights summing to 1.
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
  int64_t touched = 0;  // distinct experts
};

Routing random_routing(int64_t n_tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Routing r;
  std::vector<int32_t> all(z(kExperts));
  std::iota(all.begin(), all.end(), 0);
  std::set<int32_t> used;
  for (int64_t t = 0; t < n_tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t k = 0; k < kTopK; ++k) {
      r.ids.push_back(all[z(k)]);
      r.weights.push_back(1.0f / static_cast<float>(kTopK));
      used.insert(all[z(k)]);
    }
  }
  r.touched = static_cast<int64_t>(used.size());
  return r;
}

MoeCudaParams moe_params(int64_t n_tokens) {
  MoeCudaParams p;
  p.shape = {n_tokens, kTopK, kExperts, kExperts, true};
  p.hidden = kLatent;
  p.inter = kInter;
  p.expert_format = WeightFormat::kMxfp4;
  p.act = {ops::MoeGlu::kSitu, 4.0f, 25.0f};
  p.out_type = MoeOutType::kBf16;
  p.accumulate = true;  // as the K3 latent MoE calls it
  return p;
}

// Bytes an expert FFN over n tokens must move: the touched experts' weights, the gathered rows in, the GLU output
// out and back, the expert outputs out.
double ffn_bytes(int64_t n_tokens, int64_t touched) {
  const double slots = d(n_tokens * kTopK);
  return d(touched) * expert_bytes() + slots * d(kLatent + 2 * kInter + kLatent) * 2;
}

enum class MoePart {
  kW4a16, kW4a16Wgmma, kW4a16Wide, kW4a16Rows, kW4a16Prefill, kW4a16PrefillRouted,
  kFfn, kRouted, kDispatch, kGrouped, kGroupedPerExpert, kGroupedDequant, kFp8, kFp8Convert
};

// Random bytes in the load-time W4A16 layout (codes and stored scales): the kernels' timing does not depend on the
// values. The FP8 conversion's does (its exact fallback for stored scales below 121, moe_fp8.h): for it every stage
// block's scale bytes are set to 246 (2^-7 with no shift, the middle of real MXFP4 experts' 2^-9 .. 2^-5), on the
// stream the memory was filled on.
ops::MoeW4a16Weights random_w4a16(CaseMemory& mem, std::optional<cudaStream_t> typical_scales = std::nullopt) {
  ops::MoeW4a16Weights w;
  w.info = ops::moe_w4a16_layout_info(kExperts, kLatent, kInter);
  uint8_t* base = mem.bytes(z(w.info.total_bytes));
  std::vector<const void*> blocks;
  for (int64_t e = 0; e < kExperts; ++e) blocks.push_back(base + e * w.info.block_bytes);
  w.blocks = mem.upload(blocks);
  if (typical_scales) {
    constexpr int kTypicalStoredScale = 246;
    for (int64_t e = 0; e < kExperts; ++e) {
      for (const ops::MoeW4a16MatrixInfo* m : {&w.info.gate_up, &w.info.down}) {
        BG_CUDA_CHECK(cudaMemset2DAsync(base + e * w.info.block_bytes + m->offset_bytes + ops::w4::kCodeBytes,
                                        ops::w4::kStageBytes, kTypicalStoredScale, ops::w4::kScaleBytes,
                                        z(int64_t{m->n_items} * m->n_kstages), *typical_scales));
      }
    }
  }
  return w;
}

// The FP8 path over a dispatched, gathered workspace: its plan (row counts read once here), the converted experts'
// scratch, the call buffer with the experts' first rows written, and its own cuBLASLt handle, whose algorithms are
// found by one run here (outside the captured launches). Launch = the whole FFN or the conversion alone.
PreparedKernel fp8_kernel(const CudaEnv& env, CaseMemory& mem, const MoeCudaParams& p,
                          const std::shared_ptr<MoeDispatchBuffers>& disp, MoePart part) {
  auto packed = std::make_shared<ops::MoeW4a16Weights>(random_w4a16(mem, env.stream));
  const int64_t per_group = ops::moe_grouped_group_experts(p.hidden, p.inter, ops::kMoeGroupedScratchBudgetBytes);
  auto plan = std::make_shared<ops::MoeGroupedPlan>(
      ops::moe_grouped_plan_from_device(p, disp->ws, per_group, env.stream));
  auto gemm = std::make_shared<ops::MoeFp8Gemm>();
  const ops::MoeFp8ExpertLayout el = ops::moe_fp8_expert_layout(p.hidden, p.inter);
  const ops::MoeFp8CallLayout cl = ops::moe_fp8_call_layout(*plan);
  ops::MoeFp8Args a;
  a.plan = plan.get();
  a.packed = packed.get();
  a.ws = disp->ws;
  a.expert_scratch_bytes = z(per_group) * el.bytes;
  a.expert_scratch = mem.zeros(a.expert_scratch_bytes);
  a.call_buffer_bytes = cl.bytes;
  a.call_buffer = mem.zeros(cl.bytes);
  a.gemm = gemm.get();
  a.cublas_workspace = env.cublas_workspace;
  a.cublas_workspace_bytes = env.cublas_workspace_bytes;
  ops::moe_fp8_write_table(*plan, a.call_buffer, a.call_buffer_bytes, env.stream);
  const double touched = d(plan->n_active());
  PreparedKernel k;
  if (part == MoePart::kFp8Convert) {
    k.cost = {touched * (expert_bytes() + d(el.bytes)), 0.0};
  } else {
    ops::moe_expert_ffn_fp8_cuda(p, a, env.stream);  // every expert's algorithm found before the capture
    k.cost = {ffn_bytes(p.shape.n_tokens, plan->n_active()), 2.0 * d(p.shape.n_pairs()) * expert_params()};
  }
  BG_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  // `a` points at *plan, *packed and *gemm: the lambda owns them (and the dispatch buffers) while it lives.
  const bool convert = part == MoePart::kFp8Convert;
  k.launch = [=](int, cudaStream_t s) {
    (void)disp;
    (void)gemm;
    if (!convert) return ops::moe_expert_ffn_fp8_cuda(p, a, s);
    for (const ops::MoeGroupedGroup& g : plan->groups) {
      ops::moe_fp8_convert_w4a16_cuda(*plan, g, *packed, a.expert_scratch, disp->ws.error_flags, s);
    }
  };
  log::info("bench moe_prefill_fp8: T={} {} touched experts in {} groups of <= {}", p.shape.n_tokens,
            plan->n_active(), plan->groups.size(), per_group);
  return k;
}

// The grouped path over a dispatched, gathered workspace: its plan (the row counts read once here, outside the
// captured launches), scratch and pointer arrays. Launch = the whole FFN (dequant included) or the dequant alone.
PreparedKernel grouped_kernel(const CudaEnv& env, CaseMemory& mem, const MoeCudaParams& p,
                              const std::shared_ptr<MoeDispatchBuffers>& disp, const ExpertWeightsCuda* experts,
                              MoePart part) {
  const bool dequant_only = part == MoePart::kGroupedDequant;
  const int64_t per_group = ops::moe_grouped_group_experts(p.hidden, p.inter, ops::kMoeGroupedScratchBudgetBytes);
  auto plan = std::make_shared<ops::MoeGroupedPlan>(
      ops::moe_grouped_plan_from_device(p, disp->ws, per_group, env.stream));
  ops::MoeGroupedArgs a;
  a.plan = plan.get();
  a.experts = experts;
  a.ws = disp->ws;
  a.ctx = {env.cublas, env.cublas_workspace, env.cublas_workspace_bytes,
           part == MoePart::kGroupedPerExpert ? ops::MoeGroupedGemmApi::kPerExpert : ops::MoeGroupedGemmApi::kGrouped};
  a.bufs.weight_bytes = z(per_group) * ops::moe_grouped_expert_bytes(p.hidden, p.inter);
  a.bufs.weights = static_cast<bf16*>(mem.zeros(a.bufs.weight_bytes));
  a.bufs.gu_bytes = ops::moe_grouped_gu_bytes(*plan);
  a.bufs.gu = static_cast<bf16*>(mem.zeros(std::max<size_t>(1, a.bufs.gu_bytes)));
  a.bufs.pointer_bytes = ops::moe_grouped_pointer_bytes(*plan);
  a.bufs.pointers = static_cast<void**>(mem.zeros(std::max<size_t>(1, a.bufs.pointer_bytes)));
  ops::moe_grouped_write_pointers(a, env.stream);
  BG_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  const double touched = d(plan->n_active());
  PreparedKernel k;
  if (dequant_only) {
    // Packed weights in, bf16 weights out.
    k.cost = {touched * (expert_bytes() + d(ops::moe_grouped_expert_bytes(kLatent, kInter))), 0.0};
    k.launch = [=](int, cudaStream_t s) {
      (void)disp;
      for (size_t g = 0; g < plan->groups.size(); ++g) ops::moe_grouped_dequant_cuda(p, a, g, s);
    };
  } else {
    k.cost = {ffn_bytes(p.shape.n_tokens, plan->n_active()), 2.0 * d(p.shape.n_pairs()) * expert_params()};
    // `a` points at *plan: the lambda must own the plan (and the dispatch buffers) for as long as it lives.
    k.launch = [=](int, cudaStream_t s) {
      (void)disp;
      (void)plan;
      ops::moe_expert_ffn_grouped_cuda(p, a, s);
    };
  }
  log::info("bench moe_prefill_grouped: T={} {} touched experts in {} groups of <= {}", p.shape.n_tokens,
            plan->n_active(), plan->groups.size(), per_group);
  return k;
}

KernelCase moe_case(const std::string& name, int64_t n_tokens, MoePart part) {
  KernelCase c;
  c.name = name;
  c.shape = fmt::format("T={} rows/expert={}", n_tokens, n_tokens * kTopK / kExperts);
  c.set_bytes = d(kExperts) * expert_bytes();  // far beyond the L2: one set
  // Decode (a few rows per expert) is bound by the weight bytes: its compute reference is the dense GEMM peak, not the
  // grouped GEMM at the same rows per expert (itself memory-bound there, so a 4-bit kernel would score above 1).
  const bool w4a16 = part == MoePart::kW4a16 || part == MoePart::kW4a16Wgmma || part == MoePart::kW4a16Wide ||
                     part == MoePart::kW4a16Rows;
  c.compute_ref = w4a16 || n_tokens <= 256 ? ComputeRef::kGemm : ComputeRef::kGroupedGemm;
  c.rows_per_expert = std::max<int64_t>(1, n_tokens * kTopK / kExperts);
  c.prepare = [=](const CudaEnv& env, CaseMemory& mem, int) {
    const MoeCudaParams p = moe_params(n_tokens);
    ops::moe_check_params(p);
    const Routing routing = random_routing(n_tokens, 5);
    const int32_t* ids = mem.upload(routing.ids);
    const float* weights = mem.upload(routing.weights);
    const bf16* x = mem.bf16(z(n_tokens * kLatent));
    void* out = mem.zeros(z(n_tokens * kLatent) * 2);
    // The dispatch buffers live as long as the launch closure.
    auto disp = std::make_shared<MoeDispatchBuffers>(p);
    const ops::MoeWorkspace ws = disp->ws;
    ops::moe_dispatch_cuda(p, ids, weights, ws, env.stream);
    PreparedKernel k;
    const double flops = 2.0 * d(n_tokens * kTopK) * expert_params();
    const double io = d(n_tokens * kLatent) * 2 * 2;  // x in, out read-modify-written
    const double slots = d(n_tokens * kTopK);
    const bool prefill = part == MoePart::kW4a16Prefill || part == MoePart::kW4a16PrefillRouted;
    if (part == MoePart::kFp8 || part == MoePart::kFp8Convert) {
      ops::moe_gather_cuda(p, x, ws, env.stream);
      return fp8_kernel(env, mem, p, disp, part);
    }
    if (w4a16 || prefill) {
      const ops::MoeW4a16Weights w = random_w4a16(mem);
      // Rows out: an expert-parallel rank's case, its rows already in dispatch order (gathered here, in setup).
      const bool rows = part == MoePart::kW4a16Rows;
      if (rows) ops::moe_gather_cuda(p, x, ws, env.stream);
      if (prefill) {
        const ops::MoeW4a16Params pp = ops::moe_w4a16_rows_params(p);
        void* plan = mem.zeros(ops::moe_w4a16_prefill_workspace_bytes(pp, true));
        // Packed bytes of the touched experts + the rows in (gathered from x inside the kernel, as the backend runs
        // it), h out and back, y out.
        k.cost = {d(routing.touched) * d(w.info.gate_up.slot_bytes + w.info.down.slot_bytes) +
                      slots * d(kLatent + 2 * kInter + kLatent) * 2,
                  flops};
        const bool routed = part == MoePart::kW4a16PrefillRouted;
        if (routed) k.cost.bytes += io + slots * d(kLatent) * 2 + slots * 8;  // + the combine: y rows, weights, out
        k.launch = [=](int, cudaStream_t s) {
          (void)disp;
          ops::moe_w4a16_prefill_cuda(pp, w, ws, {x, true, ws.h, ws.y_perm, plan}, s);
          if (routed) ops::moe_combine_cuda(p, ws, out, s);
        };
        return k;
      }
      ops::MoeW4a16Params wp = rows ? ops::moe_w4a16_rows_params(p) : ops::moe_w4a16_params(p);
      if (part == MoePart::kW4a16Wgmma) wp.wgmma = true;
      if (part == MoePart::kW4a16Wide) wp.narrow = false;
      const ops::MoeW4a16Workspace wws =
          ops::moe_w4a16_workspace_layout(wp, mem.zeros(ops::moe_w4a16_workspace_bytes(wp)));
      // Packed bytes of the touched experts + x in + out read-modify-written (h stays on chip or in L2).
      k.cost = {d(routing.touched) * d(w.info.gate_up.slot_bytes + w.info.down.slot_bytes) + io, flops};
      const bf16* in = rows ? ws.x_perm : x;
      void* dst = rows ? static_cast<void*>(ws.y_perm) : out;
      k.launch = [=](int, cudaStream_t s) {
        (void)disp;
        ops::moe_w4a16_cuda(wp, w, ws, {in, dst}, wws, s);
      };
      return k;
    }
    // The stage FFN alone reads a gathered workspace: gather once here.
    ops::moe_gather_cuda(p, x, ws, env.stream);
    const ExpertWeightsCuda* experts = make_experts(mem);
    if (part == MoePart::kGrouped || part == MoePart::kGroupedPerExpert || part == MoePart::kGroupedDequant) {
      return grouped_kernel(env, mem, p, disp, experts, part);
    }
    switch (part) {
      case MoePart::kW4a16:
      case MoePart::kW4a16Wgmma:
      case MoePart::kW4a16Wide:
      case MoePart::kW4a16Rows:
      case MoePart::kW4a16Prefill:
      case MoePart::kW4a16PrefillRouted:
      case MoePart::kGrouped:
      case MoePart::kGroupedPerExpert:
      case MoePart::kGroupedDequant:
      case MoePart::kFp8:
      case MoePart::kFp8Convert:
      case MoePart::kFfn:
        k.cost = {ffn_bytes(n_tokens, routing.touched), flops};
        k.launch = [=](int, cudaStream_t s) {
          (void)disp;
          ops::moe_expert_ffn_cuda(p, experts, ws, s);
        };
        break;
      case MoePart::kRouted:
        // + gather (x rows out to the slots), combine (expert outputs back, weighted) and ids / weights.
        k.cost = {ffn_bytes(n_tokens, routing.touched) + io + slots * d(kLatent) * 4 + slots * 8, flops};
        k.launch = [=](int, cudaStream_t s) {
          (void)disp;
          ops::moe_dispatch_cuda(p, ids, weights, ws, s);
          ops::moe_gather_cuda(p, x, ws, s);
          ops::moe_expert_ffn_cuda(p, experts, ws, s);
          ops::moe_combine_cuda(p, ws, out, s);
        };
        break;
      case MoePart::kDispatch:
        k.cost = {slots * (8 + 4 * 4), 0.0};  // ids + weights in; row token / weight / slot row / rank out
        k.launch = [=](int, cudaStream_t s) {
          (void)disp;
          ops::moe_dispatch_cuda(p, ids, weights, ws, s);
        };
        break;
    }
    return k;
  };
  return c;
}

// K3's real router: top-16 of 896 global experts, one group, fp32 logits with the correction bias.
KernelCase router_case(int64_t n_tokens, std::optional<ops::RouterTopk> algo = std::nullopt) {
  constexpr int64_t kGlobalExperts = 896;
  KernelCase c;
  c.name = algo == ops::RouterTopk::kRounds ? "router_topk_rounds" : "router_topk";
  c.shape = fmt::format("B={} top16/896", n_tokens);
  c.set_bytes = d(n_tokens * kGlobalExperts) * 4;
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int n_sets) {
    const ops::RouterParams p{n_tokens, kGlobalExperts, kTopK, 1, 1, true, 1.0f};
    const float* bias = mem.f32(z(kGlobalExperts), -0.1f, 0.1f);
    std::vector<const float*> logits;
    std::vector<int32_t*> ids;
    std::vector<float*> weights;
    for (int s = 0; s < n_sets; ++s) {
      logits.push_back(mem.f32(z(n_tokens * kGlobalExperts), -2.0f, 2.0f));
      ids.push_back(mem.zeros_of<int32_t>(z(n_tokens * kTopK)));
      weights.push_back(mem.zeros_of<float>(z(n_tokens * kTopK)));
    }
    PreparedKernel k;
    k.cost = {d(n_tokens * kGlobalExperts) * 4 + d(n_tokens * kTopK) * 8, 0.0};
    k.launch = [=](int s, cudaStream_t stream) {
      ops::route_topk_cuda(p, logits[z(s)], bias, ids[z(s)], weights[z(s)], stream, algo);
    };
    return k;
  };
  return c;
}

}  // namespace

void register_moe_cases(KernelRegistry& r, bool quick) {
  const std::vector<int64_t> decode = quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 16, 64};
  for (int64_t b : decode) r.add(router_case(b));
  if (!quick) {
    for (int64_t b : decode) r.add(router_case(b, ops::RouterTopk::kRounds));
  }
  for (int64_t b : decode) r.add(moe_case("moe_decode_w4a16", b, MoePart::kW4a16));
  for (int64_t b : decode) r.add(moe_case("moe_decode_w4a16_wgmma", b, MoePart::kW4a16Wgmma));
  for (int64_t b : decode) {
    if (b <= 16) r.add(moe_case("moe_decode_w4a16_wide", b, MoePart::kW4a16Wide));
  }
  for (int64_t b : decode) r.add(moe_case("moe_decode_w4a16_rows", b, MoePart::kW4a16Rows));
  for (int64_t b : decode) r.add(moe_case("moe_decode_stages", b, MoePart::kFfn));
  for (int64_t b : decode) r.add(moe_case("moe_decode_routed", b, MoePart::kRouted));
  const std::vector<int64_t> prefill =
      quick ? std::vector<int64_t>{1024} : std::vector<int64_t>{1024, 4096, 16384};
  for (int64_t t : prefill) r.add(moe_case("moe_prefill_tiled", t, MoePart::kFfn));
  // 1024 tokens = 292 rows per expert (an EP16 rank's share of a 16k-token step over 896 experts); 4096 and 16384 =
  // 1170 and 4681 rows per expert.
  for (int64_t t : prefill) r.add(moe_case("moe_prefill_grouped", t, MoePart::kGrouped));
  for (int64_t t : prefill) r.add(moe_case("moe_prefill_grouped_per_expert", t, MoePart::kGroupedPerExpert));
  for (int64_t t : prefill) r.add(moe_case("moe_prefill_grouped_dequant", t, MoePart::kGroupedDequant));
  for (int64_t t : prefill) r.add(moe_case("moe_prefill_w4a16", t, MoePart::kW4a16Prefill));
  for (int64_t t : prefill) r.add(moe_case("moe_prefill_fp8", t, MoePart::kFp8));
  for (int64_t t : prefill) r.add(moe_case("moe_prefill_fp8_convert", t, MoePart::kFp8Convert));
  r.add(moe_case("moe_dispatch_prefill", quick ? 4096 : 16384, MoePart::kDispatch));
  // Where the W4A16 prefill kernel overtakes the fused decode kernel, which takes every row count below the threshold
  // (kMoeGroupedMinRowsW4a16): the two whole routed paths (dispatch done in setup), the prefill kernel with the
  // dispatch's combine against the fused kernel with its own, at 18 / 37 / 73 / 146 / 292 rows per expert.
  if (!quick) {
    for (int64_t t : {64, 128, 256, 512, 1024}) {
      r.add(moe_case("moe_crossover_decode_kernel", t, MoePart::kW4a16));
      r.add(moe_case("moe_crossover_prefill_kernel", t, MoePart::kW4a16PrefillRouted));
    }
  }
}

}  // namespace bg::bench::cuda
