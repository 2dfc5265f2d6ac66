// The dequantize-once prefill path of the expert FFN (moe_grouped_cuda.h): dequant kernel, GLU kernel, and the two
// cuBLAS grouped GEMMs per group of touched experts.
//
// Per group of G experts (K3: G <= 16 in the default 1 GiB scratch):
//   1. dequant: G x (gate, up, down) -> bf16 scratch, one thread per 8 weights (4 bytes of MXFP4 codes + a scale in,
//      16 bytes out), ~84 MB moved per K3 expert (~17 us at 4.8 TB/s).
//   2. gu[rows, 2 inter] = x_perm W_gu^T: one cublasGemmGroupedBatchedEx call, one problem per expert (m = 2 inter,
//      n = its rows, k = hidden), bf16 in and out, fp32 accumulation.
//   3. h = bf16(GLU(g, u)) computed in fp32 from the bf16 g and u.
//   4. y_perm[rows, hidden] = h W_down^T: a second grouped call (m = hidden, k = inter).
// In cuBLAS's column-major terms each problem is C^T = W (as [k, m], transposed) times X^T ([k, n]), exactly as
// linear_cuda's gemm_bf16 does for one weight.

#include "ops/moe/moe_grouped_cuda.h"

#include <algorithm>
#include <climits>
#include <string_view>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/linear/linear_cuda_device.cuh"
#include "ops/moe/moe_glu_device.cuh"
#include "ops/moe/moe_grouped_device.cuh"
#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops {
namespace {

using bf16 = __nv_bfloat16;

using grouped::GroupSlots;
using grouped::grid_for;
using grouped::kThreads;

// grid (x: grid-stride over one matrix, y: 3 x experts of the group): block row y dequantizes matrix y % 3 (gate, up,
// down) of the group's expert y / 3 into its place in the scratch.
template <WeightFormat F>
__global__ void __launch_bounds__(kThreads) grouped_dequant_kernel(const ExpertWeightsCuda* experts, GroupSlots g,
                                                                   int64_t hidden, int64_t inter, bf16* dst,
                                                                   int32_t* error_flags) {
  const int j = static_cast<int>(blockIdx.y) / 3, m = static_cast<int>(blockIdx.y) % 3;
  const ExpertWeightsCuda& e = experts[g.slot[j]];
  const DeviceWeight w = m == 0 ? e.gate : (m == 1 ? e.up : e.down);
  const int64_t n_out = m == 2 ? hidden : inter, n_in = m == 2 ? inter : hidden;
  if (w.format != F || w.n_out != n_out || w.n_in != n_in) {
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(error_flags, kMoeErrorBadDescriptor);
    return;  // whole block: the descriptor is the same for every thread
  }
  bf16* out = dst + static_cast<int64_t>(j) * 3 * hidden * inter + static_cast<int64_t>(m) * inter * hidden;
  const int64_t segs = (n_in + 7) / 8;
  const bool vec = n_in % 8 == 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_out * segs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / segs, k0 = (i % segs) * 8;
    float v[8];
    const float s = cudadev::load_weight8<F>(w, r, k0, v);
    bf16* d = out + r * n_in + k0;
    if (vec) {
      __align__(16) bf16 tmp[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) tmp[q] = __float2bfloat16(v[q] * s);
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(tmp);
    } else {
      for (int q = 0; q < 8 && k0 + q < n_in; ++q) d[q] = __float2bfloat16(v[q] * s);
    }
  }
}

// The same scratch from the W4A16 expert blocks (moe_w4a16.h): thread i of a matrix decodes one lane's 16 code bytes of
// one tile of one stage block (rows g and g + 8, the 16 inputs 16 t .. 16 t + 15 of the stage) exactly as the decode
// kernel does (w4::decode_word, the stored scale, 2^scale_shift), i.e. bf16(code * scale) bit for bit. grid.y: the
// group's experts x 2 (gate/up, down).
__global__ void __launch_bounds__(kThreads) grouped_dequant_w4a16_kernel(const void* const* blocks, GroupSlots g,
                                                                         MoeW4a16LayoutInfo info, bf16* dst,
                                                                         int32_t* error_flags) {
  const int j = static_cast<int>(blockIdx.y) / 2;
  const bool gate_up = blockIdx.y % 2 == 0;
  const auto* block = static_cast<const uint8_t*>(blocks[g.slot[j]]);
  if (block == nullptr) {
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(error_flags, kMoeErrorBadDescriptor);
    return;
  }
  const MoeW4a16MatrixInfo& m = gate_up ? info.gate_up : info.down;
  const int64_t H = info.hidden, I = info.inter;
  bf16* out = dst + static_cast<int64_t>(j) * 3 * H * I + (gate_up ? 0 : 2 * I * H);
  const float shift = exp2f(static_cast<float>(m.scale_shift));
  constexpr int kLaneTiles = w4::kWarps * w4::kMTiles * 32;  // per stage block
  const int64_t n = static_cast<int64_t>(m.n_items) * m.n_kstages * kLaneTiles;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t stage = i / kLaneTiles;
    const int in_stage = static_cast<int>(i % kLaneTiles);
    const int lane = in_stage & 31, mt = (in_stage >> 5) % w4::kMTiles, warp = in_stage >> 5 >> 2;
    const int item = static_cast<int>(stage / m.n_kstages), kstage = static_cast<int>(stage % m.n_kstages);
    const uint8_t* sb = block + m.offset_bytes + stage * w4::kStageBytes;
    const uint4 q = *reinterpret_cast<const uint4*>(sb + w4::code_offset(warp, mt, lane));
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    const int g8 = lane >> 2, t = lane & 3;
    int64_t rows[2];
    float scales[2];
    for (int rh = 0; rh < 2; ++rh) {
      const int r16 = g8 + 8 * rh;
      rows[rh] = gate_up ? w4::gate_up_column(item, warp, mt, r16) : w4::down_row(item, warp, mt, r16);
      scales[rh] = grouped::w4_scale(sb[w4::scale_offset(warp, g8, t >> 1, mt, rh)]);
    }
    const int64_t k0 = static_cast<int64_t>(kstage) * w4::kKStage + 16 * t;
    if (k0 >= m.n_in) continue;  // padding inputs (n_in % 32 == 0: a thread's 16 are all real or all padding)
    __align__(16) bf16 v[2][16];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t r[4];
      w4::decode_word(words[ks], r);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const auto lane_bits = static_cast<uint32_t>(r[e >> 1] >> (16 * (e & 1))) & 0xffffu;
        const int rh = w4::element_row_half(e);
        v[rh][w4::element_k(t, ks, e) - 16 * t] = __float2bfloat16(grouped::w4_weight(lane_bits, scales[rh], shift));
      }
    }
    for (int rh = 0; rh < 2; ++rh) {
      if (rows[rh] >= m.n_out) continue;  // padding rows
      const bool up = gate_up && w4::gate_up_is_up(mt);
      bf16* d = out + (rows[rh] + (up ? I : 0)) * m.n_in + k0;
      reinterpret_cast<uint4*>(d)[0] = reinterpret_cast<const uint4*>(v[rh])[0];
      reinterpret_cast<uint4*>(d)[1] = reinterpret_cast<const uint4*>(v[rh])[1];
    }
  }
}

// h[r, c] = bf16(GLU(gu[r, c], gu[r, inter + c])) for r < n_rows; 8 columns per thread when inter % 8 == 0.
__global__ void __launch_bounds__(kThreads) grouped_glu_kernel(const bf16* gu, int64_t n_rows, int64_t inter, bf16* h,
                                                               MoeGluParams act) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (inter % 8 == 0) {
    const int64_t segs = inter / 8;
    for (int64_t i = first; i < n_rows * segs; i += stride) {
      const int64_t r = i / segs, c = (i % segs) * 8;
      const uint4 gq = *reinterpret_cast<const uint4*>(gu + r * 2 * inter + c);
      const uint4 uq = *reinterpret_cast<const uint4*>(gu + r * 2 * inter + inter + c);
      const uint32_t gw[4] = {gq.x, gq.y, gq.z, gq.w}, uw[4] = {uq.x, uq.y, uq.z, uq.w};
      __align__(16) bf16 o[8];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 g2 = cudadev::bf16x2_to_float2(gw[q]), u2 = cudadev::bf16x2_to_float2(uw[q]);
        o[2 * q] = __float2bfloat16(moe_glu(g2.x, u2.x, act));
        o[2 * q + 1] = __float2bfloat16(moe_glu(g2.y, u2.y, act));
      }
      *reinterpret_cast<uint4*>(h + r * inter + c) = *reinterpret_cast<const uint4*>(o);
    }
  } else {
    for (int64_t i = first; i < n_rows * inter; i += stride) {
      const int64_t r = i / inter, c = i % inter;
      const float g = __bfloat162float(gu[r * 2 * inter + c]), u = __bfloat162float(gu[r * 2 * inter + inter + c]);
      h[r * inter + c] = __float2bfloat16(moe_glu(g, u, act));
    }
  }
}

// One grouped call over the group's experts: problem i is C_i[n_i, m] (row-major, ld m) = B_i[n_i, k] A_i^T with
// A_i [m, k] row-major; pointer arrays are device memory, offset to the group's first expert.
struct GroupedGemm {
  int m = 0, k = 0;
  const int32_t* n = nullptr;  // rows of each expert (host)
  int count = 0;
  void* const* a = nullptr;
  void* const* b = nullptr;
  void* const* c = nullptr;
};

void bind(const MoeGroupedContext& ctx, cudaStream_t stream) {
  BG_CUBLAS_CHECK(cublasSetStream(ctx.cublas, stream));
  // cublasSetStream resets the workspace to cuBLAS's own pool, so the caller's workspace is bound after it.
  BG_CUBLAS_CHECK(cublasSetWorkspace(ctx.cublas, ctx.cublas_workspace, ctx.cublas_workspace_bytes));
}

// The same problems as grouped_gemm, one cublasGemmEx each; a, b, c are host copies of the pointer arrays.
void per_expert_gemm(const MoeGroupedContext& ctx, const GroupedGemm& g, cudaStream_t stream) {
  bind(ctx, stream);
  const float alpha = 1.0f, beta = 0.0f;
  for (int i = 0; i < g.count; ++i) {
    BG_CUBLAS_CHECK(cublasGemmEx(ctx.cublas, CUBLAS_OP_T, CUBLAS_OP_N, g.m, g.n[i], g.k, &alpha, g.a[i], CUDA_R_16BF,
                                 g.k, g.b[i], CUDA_R_16BF, g.k, &beta, g.c[i], CUDA_R_16BF, g.m, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
  }
}

void grouped_gemm(const MoeGroupedContext& ctx, const GroupedGemm& g, cudaStream_t stream) {
  bind(ctx, stream);
  const auto count = static_cast<size_t>(g.count);
  const std::vector<cublasOperation_t> ta(count, CUBLAS_OP_T), tb(count, CUBLAS_OP_N);
  const std::vector<int> m(count, g.m), k(count, g.k), lda(count, g.k), ldb(count, g.k), ldc(count, g.m);
  const std::vector<int> n(g.n, g.n + g.count), group_size(count, 1);
  const std::vector<float> alpha(count, 1.0f), beta(count, 0.0f);
  BG_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      ctx.cublas, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(),
      const_cast<const void* const*>(g.a), CUDA_R_16BF, lda.data(), const_cast<const void* const*>(g.b), CUDA_R_16BF,
      ldb.data(), beta.data(), g.c, CUDA_R_16BF, ldc.data(), g.count, group_size.data(), CUBLAS_COMPUTE_32F));
}

void check_args(const MoeCudaParams& p, const MoeGroupedArgs& a) {
  BG_CHECK(a.plan != nullptr && (a.experts != nullptr || a.packed != nullptr), "moe grouped: null plan or experts");
  const MoeGroupedPlan& plan = *a.plan;
  BG_CHECK(plan.hidden == p.hidden && plan.inter == p.inter,
           "moe grouped: plan for experts [{} -> {}] launched with [{} -> {}]", plan.hidden, plan.inter, p.hidden,
           p.inter);
  BG_CHECK(p.hidden <= INT32_MAX / 2 && p.inter <= INT32_MAX / 2, "moe grouped: widths exceed the cuBLAS interface");
  int64_t most = 0;
  for (const MoeGroupedGroup& g : plan.groups) most = std::max<int64_t>(most, g.n_experts);
  const size_t need = static_cast<size_t>(most) * moe_grouped_expert_bytes(p.hidden, p.inter);
  BG_CHECK(a.bufs.weights != nullptr && a.bufs.weight_bytes >= need,
           "moe grouped: weight scratch of {} bytes, the plan's largest group needs {}", a.bufs.weight_bytes, need);
  BG_CHECK(a.bufs.gu != nullptr && a.bufs.gu_bytes >= moe_grouped_gu_bytes(plan),
           "moe grouped: gate|up buffer of {} bytes, the plan needs {}", a.bufs.gu_bytes, moe_grouped_gu_bytes(plan));
  BG_CHECK(a.bufs.pointers != nullptr && a.bufs.pointer_bytes >= moe_grouped_pointer_bytes(plan),
           "moe grouped: pointer arrays of {} bytes, the plan needs {}", a.bufs.pointer_bytes,
           moe_grouped_pointer_bytes(plan));
  BG_CHECK(a.ws.x_perm && a.ws.h && a.ws.y_perm && a.ws.error_flags, "moe grouped: incomplete dispatch workspace");
}

template <WeightFormat F>
void launch_dequant(const MoeCudaParams& p, const MoeGroupedArgs& a, const MoeGroupedGroup& g, cudaStream_t stream) {
  const GroupSlots slots = grouped::group_slots(*a.plan, g);
  // ~2 waves of 8 blocks per SM over all matrices of the group.
  const int x = grid_for(p.hidden * p.inter / 8, std::max(1, 2 * 132 * 8 / (3 * g.n_experts)));
  const dim3 grid(static_cast<unsigned>(x), static_cast<unsigned>(3 * g.n_experts));
  grouped_dequant_kernel<F><<<grid, kThreads, 0, stream>>>(a.experts, slots, p.hidden, p.inter, a.bufs.weights,
                                                           a.ws.error_flags);
  BG_CUDA_CHECK_LAUNCH();
}

void launch_dequant_w4a16(const MoeCudaParams& p, const MoeGroupedArgs& a, const MoeGroupedGroup& g,
                          cudaStream_t stream) {
  const MoeW4a16Weights& w = *a.packed;
  BG_CHECK(w.info.version == kMoeW4a16LayoutVersion && w.info.hidden == p.hidden && w.info.inter == p.inter &&
               w.info.n_slots == p.shape.n_slots && w.blocks != nullptr,
           "moe grouped: W4A16 layout v{} of {} experts [{} -> {}] for a call over {} slots [{} -> {}]",
           w.info.version, w.info.n_slots, w.info.hidden, w.info.inter, p.shape.n_slots, p.hidden, p.inter);
  const GroupSlots slots = grouped::group_slots(*a.plan, g);
  const int x = grid_for(p.hidden * p.inter / 32, std::max(1, 2 * 132 * 8 / (2 * g.n_experts)));
  const dim3 grid(static_cast<unsigned>(x), static_cast<unsigned>(2 * g.n_experts));
  grouped_dequant_w4a16_kernel<<<grid, kThreads, 0, stream>>>(w.blocks, slots, w.info, a.bufs.weights,
                                                               a.ws.error_flags);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace

MoeGroupedPlan moe_grouped_plan_from_device(const MoeCudaParams& p, const MoeWorkspace& ws, int64_t group_experts,
                                            cudaStream_t stream) {
  moe_check_params(p);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  BG_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  BG_CHECK(capture == cudaStreamCaptureStatusNone,
           "moe grouped: the plan reads the dispatch's row counts on the host, which a graph capture cannot do");
  std::vector<int32_t> counts(static_cast<size_t>(p.shape.n_slots));
  if (!counts.empty()) {
    BG_CUDA_CHECK(cudaMemcpyAsync(counts.data(), ws.counts, counts.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                  stream));
  }
  BG_CUDA_CHECK(cudaStreamSynchronize(stream));
  return moe_grouped_plan(counts, p.hidden, p.inter, group_experts, p.shape.n_pairs());
}

MoeGroupedGemmApi moe_grouped_gemm_api(const char* env_value) {
  return env_choice("BG_MOE_GROUPED_GEMM", env_value, {"per_expert", "grouped"}) == 1 ? MoeGroupedGemmApi::kGrouped
                                                                                       : MoeGroupedGemmApi::kPerExpert;
}

namespace {

// The pointer arrays of every GEMM of the plan (host): per touched expert i of n, A_gu, B_gu, C_gu, A_down, B_down,
// C_down at [k * n + i].
std::vector<void*> pointer_table(const MoeGroupedArgs& a) {
  const MoeGroupedPlan& plan = *a.plan;
  const size_t n = static_cast<size_t>(plan.n_active());
  const int64_t H = plan.hidden, I = plan.inter, expert_elems = 3 * H * I;
  std::vector<void*> host(6 * n);
  for (const MoeGroupedGroup& g : plan.groups) {
    for (int j = 0; j < g.n_experts; ++j) {
      const size_t i = static_cast<size_t>(g.first + j);
      const int64_t row = plan.row_begin[i];
      bf16* w = a.bufs.weights + j * expert_elems;
      host[i] = w;                                              // W_gu [2I, H]
      host[n + i] = a.ws.x_perm + row * H;                      // x rows [rows, H]
      host[2 * n + i] = a.bufs.gu + (row - g.row_begin) * 2 * I;  // gu rows [rows, 2I]
      host[3 * n + i] = w + 2 * I * H;                          // W_down [H, I]
      host[4 * n + i] = a.ws.h + row * I;                       // h rows [rows, I]
      host[5 * n + i] = a.ws.y_perm + row * H;                  // y rows [rows, H]
    }
  }
  return host;
}

}  // namespace

void moe_grouped_write_pointers(const MoeGroupedArgs& a, cudaStream_t stream) {
  BG_CHECK(a.plan != nullptr, "moe grouped: null plan");
  const MoeGroupedPlan& plan = *a.plan;
  if (plan.n_active() == 0) return;
  BG_CHECK(a.bufs.pointers != nullptr && a.bufs.pointer_bytes >= moe_grouped_pointer_bytes(plan),
           "moe grouped: pointer arrays of {} bytes, the plan needs {}", a.bufs.pointer_bytes,
           moe_grouped_pointer_bytes(plan));
  const std::vector<void*> host = pointer_table(a);
  // From pageable memory: staged before cudaMemcpyAsync returns, so `host` may go out of scope.
  BG_CUDA_CHECK(
      cudaMemcpyAsync(a.bufs.pointers, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice, stream));
}

void moe_grouped_dequant_cuda(const MoeCudaParams& p, const MoeGroupedArgs& a, size_t group, cudaStream_t stream) {
  check_args(p, a);
  BG_CHECK(group < a.plan->groups.size(), "moe grouped: group {} of {}", group, a.plan->groups.size());
  const MoeGroupedGroup& g = a.plan->groups[group];
  if (a.packed != nullptr) {
    BG_CHECK(p.expert_format == WeightFormat::kMxfp4, "moe grouped: a W4A16 layout for {} experts",
             weight_format_name(p.expert_format));
    return launch_dequant_w4a16(p, a, g, stream);
  }
  switch (p.expert_format) {
    case WeightFormat::kDense: return launch_dequant<WeightFormat::kDense>(p, a, g, stream);
    case WeightFormat::kFp8Block: return launch_dequant<WeightFormat::kFp8Block>(p, a, g, stream);
    case WeightFormat::kMxfp4: return launch_dequant<WeightFormat::kMxfp4>(p, a, g, stream);
  }
  fail("moe grouped: unknown weight format {}", static_cast<int>(p.expert_format));
}

void moe_expert_ffn_grouped_cuda(const MoeCudaParams& p, const MoeGroupedArgs& a, cudaStream_t stream) {
  moe_check_params(p);
  check_args(p, a);
  BG_CHECK(a.ctx.cublas != nullptr && a.ctx.cublas_workspace != nullptr && a.ctx.cublas_workspace_bytes > 0,
           "moe grouped: no cuBLAS handle or workspace in the context");
  const MoeGroupedPlan& plan = *a.plan;
  const size_t n = static_cast<size_t>(plan.n_active());
  const bool per_expert = a.ctx.api == MoeGroupedGemmApi::kPerExpert;
  // Per expert: cublasGemmEx takes its pointers on the host (the same table, not the device copy).
  const std::vector<void*> host = per_expert ? pointer_table(a) : std::vector<void*>();
  void* const* ptr = per_expert ? host.data() : a.bufs.pointers;
  const auto gemm = per_expert ? per_expert_gemm : grouped_gemm;
  const auto H = static_cast<int>(p.hidden), I = static_cast<int>(p.inter);
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    const MoeGroupedGroup& g = plan.groups[gi];
    const size_t f = static_cast<size_t>(g.first);
    moe_grouped_dequant_cuda(p, a, gi, stream);
    const int32_t* rows = plan.rows.data() + f;
    gemm(a.ctx, {2 * I, H, rows, g.n_experts, ptr + f, ptr + n + f, ptr + 2 * n + f}, stream);
    const int glu_grid = grid_for(g.n_rows * std::max<int64_t>(1, p.inter / 8), 132 * 16);
    grouped_glu_kernel<<<glu_grid, kThreads, 0, stream>>>(a.bufs.gu, g.n_rows, p.inter, a.ws.h + g.row_begin * p.inter,
                                                         p.act);
    BG_CUDA_CHECK_LAUNCH();
    gemm(a.ctx, {H, I, rows, g.n_experts, ptr + 3 * n + f, ptr + 4 * n + f, ptr + 5 * n + f}, stream);
  }
}

}  // namespace bg::ops
