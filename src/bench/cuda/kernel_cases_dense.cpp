// Kernel cases of the dense path at Kimi-K3 shapes: the bf16 linears of a layer and the lm_head (through linear_cuda:
// cuBLAS, or with BG_LINEAR_DECODE=1 the decode GEMM up to 64 tokens), the FP8 / MXFP4 linear paths, and the
// small per-token ops (norms, AttnRes mix, residual add, SiTU, sigmoid gate, embedding, KDA gate / L2 norm / beta,
// gated RMSNorm, GPU sampling). Not here: RoPE and SwiGLU, which K3 does
// not run (DeepSeek-V3 only). Each registration: name, shape, bytes of one input set, prepare.
#include <fmt/format.h>

#include <cmath>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "bench/cuda/kernel_case.h"
#include "ops/attn_res/attn_res_cuda.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/embedding/embedding_cuda.h"
#include "ops/gated_rmsnorm/gated_rmsnorm_cuda.h"
#include "ops/kda_gate/kda_gate_cuda.h"
#include "ops/linear/linear_cuda.h"
#include "ops/rmsnorm/rmsnorm_cuda.h"
#include "ops/sampling/sampling_cuda.h"
#include "ops/situ/situ_cuda.h"

namespace bg::bench::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int64_t kHidden = 7168, kKdaProj = 96 * 128, kHeads = 96, kHeadDim = 128, kVocab = 163840;

std::vector<int64_t> decode_batches(bool quick) {
  return quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 16, 64};
}

double d(int64_t v) { return static_cast<double>(v); }
size_t z(int64_t v) { return static_cast<size_t>(v); }

// The dense decode GEMM's workspace in the case's memory (zeroed, so its counters start at zero) with
// BG_LINEAR_DECODE=1, as the backend then keeps one; null otherwise (cuBLAS for every dense GEMM, the default).
std::shared_ptr<const ops::DenseDecodeWorkspace> decode_workspace(CaseMemory& mem) {
  if (!ops::dense_decode_enabled()) return nullptr;
  return std::make_shared<const ops::DenseDecodeWorkspace>(
      ops::dense_decode_workspace(mem.zeros(ops::dense_decode_workspace_bytes())));
}

// y[rows, out] = x[rows, in] W^T through ops::linear_cuda with a bf16 weight (every K3 dense linear is bf16).
KernelCase linear_case(const std::string& name, int64_t rows, int64_t n_out, int64_t n_in, bool f32_out) {
  const double out_bytes = d(rows * n_out) * (f32_out ? 4.0 : 2.0);
  const double set = d(n_out * n_in) * 2.0 + d(rows * n_in) * 2.0 + out_bytes;
  KernelCase c;
  c.name = name;
  c.shape = fmt::format("T={} {}x{}", rows, n_out, n_in);
  c.set_bytes = set;
  c.prepare = [=](const CudaEnv& env, CaseMemory& mem, int n_sets) {
    std::vector<ops::DeviceWeight> w(z(n_sets));
    std::vector<const bf16*> x(z(n_sets));
    std::vector<void*> y(z(n_sets));
    const float scale = 1.0f / std::sqrt(static_cast<float>(n_in));
    for (int s = 0; s < n_sets; ++s) {
      w[z(s)] = {WeightFormat::kDense, n_out, n_in, mem.bf16(z(n_out * n_in), scale), nullptr};
      x[z(s)] = mem.bf16(z(rows * n_in));
      y[z(s)] = mem.zeros(static_cast<size_t>(out_bytes));
    }
    const ops::LinearCudaParams p{rows, f32_out ? ops::LinearOutType::kF32 : ops::LinearOutType::kBf16,
                                  ops::LinearPath::kAuto};
    const std::shared_ptr<const ops::DenseDecodeWorkspace> ws = decode_workspace(mem);
    const ops::LinearCudaContext ctx{env.cublas, env.cublas_workspace, env.cublas_workspace_bytes, nullptr, 0,
                                     ws.get()};
    PreparedKernel k;
    k.cost = {set, 2.0 * d(rows) * d(n_out) * d(n_in)};
    k.launch = [=](int s, cudaStream_t stream) { ops::linear_cuda(p, w[z(s)], x[z(s)], y[z(s)], ctx, stream); };
    return k;
  };
  return c;
}

// A fused group of linears that read one input, as CudaBackend::linear_group runs it: the decode GEMM writing each
// part's output directly, or (cuBLAS) one GEMM over the parts' concatenated weights into [rows, sum of n_out], then
// (above one row) one split launch into each part's output.
KernelCase linear_group_case(const std::string& name, int64_t rows, const std::vector<int64_t>& parts, int64_t n_in) {
  int64_t n_out = 0;
  for (int64_t p : parts) n_out += p;
  const double out_bytes = d(rows * n_out) * 2.0;
  const double set = d(n_out * n_in) * 2.0 + d(rows * n_in) * 2.0 + out_bytes * (rows > 1 ? 3.0 : 1.0);
  KernelCase c;
  c.name = name;
  c.shape = fmt::format("T={} {}x{} in {} parts", rows, n_out, n_in, parts.size());
  c.set_bytes = set;
  c.prepare = [=](const CudaEnv& env, CaseMemory& mem, int n_sets) {
    struct Set {
      ops::DeviceWeight w;
      const bf16* x;
      bf16* all;
      std::vector<ops::ColumnSlice> slices;
    };
    std::vector<Set> sets(z(n_sets));
    const float scale = 1.0f / std::sqrt(static_cast<float>(n_in));
    for (Set& st : sets) {
      st.w = {WeightFormat::kDense, n_out, n_in, mem.bf16(z(n_out * n_in), scale), nullptr};
      st.x = mem.bf16(z(rows * n_in));
      st.all = mem.zeros_of<bf16>(z(rows * n_out));
      int64_t col = 0;
      for (int64_t p : parts) {
        st.slices.push_back({col, p, mem.zeros_of<bf16>(z(rows * p))});
        col += p;
      }
    }
    const ops::LinearCudaParams p{rows, ops::LinearOutType::kBf16, ops::LinearPath::kAuto};
    const std::shared_ptr<const ops::DenseDecodeWorkspace> ws = decode_workspace(mem);
    const ops::LinearCudaContext ctx{env.cublas, env.cublas_workspace, env.cublas_workspace_bytes, nullptr, 0,
                                     ws.get()};
    PreparedKernel k;
    k.cost = {set, 2.0 * d(rows) * d(n_out) * d(n_in)};
    k.launch = [=](int s, cudaStream_t stream) {
      const Set& st = sets[z(s)];
      if (ops::dense_decode_applies(p, st.w, st.x, ctx)) {
        ops::dense_decode_parts_cuda(p, st.w, st.x, st.slices, *ws, stream);
        return;
      }
      ops::linear_cuda(p, st.w, st.x, st.all, ctx, stream);
      if (rows > 1) ops::split_columns_cuda(rows, st.all, n_out, st.slices, stream);
    };
    return k;
  };
  return c;
}

// The quantized linear paths (DeepSeek-V3's FP8 128 x 128 block weights; MXFP4 dense weights): the skinny
// weight-streaming kernel up to 16 tokens, dequantize + cuBLAS above.
KernelCase quant_linear_case(const std::string& name, int64_t rows, int64_t n_out, int64_t n_in, WeightFormat format) {
  const bool fp8 = format == WeightFormat::kFp8Block;
  const int64_t scales = fp8 ? ((n_out + 127) / 128) * ((n_in + 127) / 128) : n_out * (n_in / 32);
  const double weight_bytes = fp8 ? d(n_out * n_in) + d(scales) * 4 : d(n_out * n_in) / 2 + d(scales);
  const double set = weight_bytes + d(rows * (n_in + n_out)) * 2.0;
  KernelCase c;
  c.name = name;
  c.shape = fmt::format("T={} {}x{}", rows, n_out, n_in);
  c.set_bytes = set;
  c.prepare = [=](const CudaEnv& env, CaseMemory& mem, int n_sets) {
    std::vector<ops::DeviceWeight> w(z(n_sets));
    std::vector<const bf16*> x(z(n_sets));
    std::vector<bf16*> y(z(n_sets));
    for (int s = 0; s < n_sets; ++s) {
      const void* codes = fp8 ? static_cast<const void*>(mem.fp8(z(n_out * n_in)))
                              : static_cast<const void*>(mem.bytes(z(n_out * n_in / 2)));
      const void* scale = fp8 ? static_cast<const void*>(mem.f32(z(scales), 1e-3f, 2e-3f))
                              : static_cast<const void*>(mem.e8m0(z(scales)));
      w[z(s)] = {format, n_out, n_in, codes, scale};
      x[z(s)] = mem.bf16(z(rows * n_in));
      y[z(s)] = mem.zeros_of<bf16>(z(rows * n_out));
    }
    const ops::LinearCudaParams p{rows, ops::LinearOutType::kBf16, ops::LinearPath::kAuto};
    const size_t scratch_bytes = ops::linear_dequant_scratch_bytes(w[0], p);
    void* scratch = scratch_bytes > 0 ? mem.zeros(scratch_bytes) : nullptr;
    const ops::LinearCudaContext ctx{env.cublas, env.cublas_workspace, env.cublas_workspace_bytes, scratch,
                                     scratch_bytes};
    PreparedKernel k;
    k.cost = {set, 2.0 * d(rows) * d(n_out) * d(n_in)};
    k.launch = [=](int s, cudaStream_t stream) { ops::linear_cuda(p, w[z(s)], x[z(s)], y[z(s)], ctx, stream); };
    return k;
  };
  return c;
}

void register_linears(KernelRegistry& r, bool quick) {
  struct Shape {
    const char* name;
    int64_t n_out, n_in;
    bool f32_out;
  };
  // The layer's linears today (KDA q / k / v / g / o each [12288 x 7168] or its transpose; MLA q_a / q_b / kv_a; latent
  // MoE down / up and shared expert), the concatenated KDA projection a fused design would read, the router, layer
  // 0's dense FFN and the lm_head (fp32 logits).
  const Shape shapes[] = {
      {"linear_bf16_decode_kda_proj", kKdaProj, kHidden, false},
      {"linear_bf16_decode_qkvg", 4 * kKdaProj, kHidden, false},
      {"linear_bf16_decode_o_proj", kHidden, kKdaProj, false},
      {"linear_bf16_decode_mla_q_a", 1536, kHidden, false},
      {"linear_bf16_decode_mla_q_b", kHeads * 192, 1536, false},
      {"linear_bf16_decode_mla_kv_a", 576, kHidden, false},
      {"linear_bf16_decode_latent_down", 3584, kHidden, false},
      {"linear_bf16_decode_latent_up", kHidden, 3584, false},
      {"linear_bf16_decode_shared_gate", 6144, kHidden, false},
      {"linear_bf16_decode_shared_down", kHidden, 6144, false},
      {"linear_bf16_decode_kda_f_a", kHeadDim, kHidden, false},
      {"linear_bf16_decode_router", 896, kHidden, true},
      {"linear_bf16_decode_dense_gate_up", 2 * 33792, kHidden, false},  // layer 0's dense FFN, gate | up fused
      {"linear_bf16_decode_dense_down", kHidden, 33792, false},
      {"lm_head_decode", kVocab, kHidden, true},
  };
  for (const Shape& s : shapes) {
    for (int64_t b : decode_batches(quick)) r.add(linear_case(s.name, b, s.n_out, s.n_in, s.f32_out));
  }
  // The fused groups the K3 model runs at decode (model/kimi_k3.cpp, K3Layer): KDA q | k | v | g | f_a | b; MLA
  // q_a | kv_a | gate; latent-down | shared gate | shared up.
  for (int64_t b : decode_batches(quick)) {
    r.add(linear_group_case("linear_group_decode_kda_in", b, {kKdaProj, kKdaProj, kKdaProj, kKdaProj, kHeadDim, kHeads},
                            kHidden));
    r.add(linear_group_case("linear_group_decode_mla_in", b, {1536, 576, kHeads * kHeadDim}, kHidden));
    r.add(linear_group_case("linear_group_decode_moe_in", b, {3584, 6144, 6144}, kHidden));
  }
  for (int64_t t : quick ? std::vector<int64_t>{4096} : std::vector<int64_t>{1024, 4096, 16384}) {
    r.add(linear_case("linear_bf16_prefill_kda_proj", t, kKdaProj, kHidden, false));
  }
  for (int64_t b : decode_batches(quick)) {
    r.add(quant_linear_case("linear_fp8_decode", b, 24576, kHidden, WeightFormat::kFp8Block));
    r.add(quant_linear_case("linear_mxfp4_decode", b, kKdaProj, kHidden, WeightFormat::kMxfp4));
  }
}

// A case over per-set buffers of plain elementwise / per-row ops: `make` allocates one set and returns its launch.
using SetLaunch = std::function<void(cudaStream_t)>;
KernelCase small_case(const std::string& name, int64_t b, double set_bytes, KernelCost cost,
                      std::function<SetLaunch(CaseMemory&)> make) {
  KernelCase c;
  c.name = name;
  c.shape = fmt::format("B={}", b);
  c.set_bytes = set_bytes;
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int n_sets) {
    std::vector<SetLaunch> sets;
    for (int s = 0; s < n_sets; ++s) sets.push_back(make(mem));
    PreparedKernel k;
    k.cost = cost;
    k.launch = [sets](int s, cudaStream_t stream) { sets[z(s)](stream); };
    return k;
  };
  return c;
}

void register_norms_and_mixes(KernelRegistry& r, int64_t b) {
  const double act = d(b * kHidden) * 2.0;
  r.add(small_case("rmsnorm", b, 2 * act, {2 * act + d(kHidden) * 4, 4 * d(b * kHidden)}, [b](CaseMemory& m) {
    const bf16* x = m.bf16(z(b * kHidden));
    const float* w = m.f32(z(kHidden), 0.9f, 1.1f);
    bf16* y = m.zeros_of<bf16>(z(b * kHidden));
    return SetLaunch([=](cudaStream_t s) { ops::rmsnorm_cuda({b, kHidden, 1e-5f}, x, w, y, s); });
  }));
  // AttnRes over 9 candidates: the most a 93-layer K3 has (8 banked block inputs + the partial sum).
  const int64_t n = 9;
  r.add(small_case("attn_res_mix", b, d(n) * act + act, {d(n) * act + act, 6 * d(n * b * kHidden)},
                   [b](CaseMemory& m) {
    const bf16* bank = m.bf16(z(n * b * kHidden));
    const float* norm = m.f32(z(kHidden), 0.9f, 1.1f);
    const float* proj = m.f32(z(kHidden), -0.02f, 0.02f);
    bf16* out = m.zeros_of<bf16>(z(b * kHidden));
    return SetLaunch([=](cudaStream_t s) { ops::attn_res_mix_cuda({n, b, kHidden, 1e-5f}, bank, norm, proj, out, s); });
  }));
  // The same mix fused with the next sublayer's RMSNorm (what the K3 model runs): h and x written, h read back; with
  // 9 candidates on the default kernel (a cluster per token there) and on the one-block-per-token kernel (`_block`),
  // with 3 (`_n3`: a first block's layers, as in the 4-layer slice; the default takes the block kernel there) on both.
  struct Mix {
    const char* name;
    ops::AttnResKernel kernel;
    int64_t n;
  };
  for (const Mix mix : {Mix{"attn_res_mix_rmsnorm", ops::AttnResKernel::kAuto, 9},
                        Mix{"attn_res_mix_rmsnorm_block", ops::AttnResKernel::kBlock, 9},
                        Mix{"attn_res_mix_rmsnorm_cluster_n3", ops::AttnResKernel::kCluster, 3},
                        Mix{"attn_res_mix_rmsnorm_block_n3", ops::AttnResKernel::kBlock, 3}}) {
    const int64_t c = mix.n;
    r.add(small_case(mix.name, b, d(c) * act + 3 * act,
                     {d(c) * act + 3 * act + d(kHidden) * 4, 6 * d(c * b * kHidden) + 4 * d(b * kHidden)},
                     [b, c, kernel = mix.kernel](CaseMemory& m) {
      const bf16* bank = m.bf16(z(c * b * kHidden));
      const float* norm = m.f32(z(kHidden), 0.9f, 1.1f);
      const float* proj = m.f32(z(kHidden), -0.02f, 0.02f);
      const float* w = m.f32(z(kHidden), 0.9f, 1.1f);
      bf16* h = m.zeros_of<bf16>(z(b * kHidden));
      bf16* x = m.zeros_of<bf16>(z(b * kHidden));
      return SetLaunch([=](cudaStream_t s) {
        ops::attn_res_mix_rmsnorm_cuda({c, b, kHidden, 1e-5f}, bank, norm, proj, w, 1e-5f, h, x, s, kernel);
      });
    }));
  }
  r.add(small_case("add", b, 2 * act, {3 * act, d(b * kHidden)}, [b](CaseMemory& m) {
    const bf16* x = m.bf16(z(b * kHidden));
    bf16* y = m.bf16(z(b * kHidden));
    return SetLaunch([=](cudaStream_t s) { ops::add_inplace_cuda(b * kHidden, x, y, s); });
  }));
  const int64_t inter = 6144;  // the shared experts' width (2 x 3072)
  r.add(small_case("situ", b, 3 * d(b * inter) * 2, {3 * d(b * inter) * 2, 12 * d(b * inter)}, [b](CaseMemory& m) {
    const bf16* g = m.bf16(z(b * inter), 4.0f);
    const bf16* u = m.bf16(z(b * inter), 8.0f);
    bf16* out = m.zeros_of<bf16>(z(b * inter));
    return SetLaunch([=](cudaStream_t s) { ops::situ_cuda({b, inter, 4.0f, 25.0f}, g, u, out, s); });
  }));
}

void register_kda_small(KernelRegistry& r, int64_t b) {
  const double proj = d(b * kKdaProj);
  r.add(small_case("kda_gate", b, proj * 6, {proj * 6 + d(kKdaProj) * 4, 6 * proj}, [b](CaseMemory& m) {
    const bf16* raw = m.bf16(z(b * kKdaProj));
    const float* a_log = m.f32(z(kHeadDim), 0.0f, 2.0f);
    const float* dt = m.f32(z(kKdaProj), -2.0f, 0.0f);
    float* g = m.zeros_of<float>(z(b * kKdaProj));
    return SetLaunch([=](cudaStream_t s) { ops::kda_gate_cuda({b, kHeads, kHeadDim, -5.0f}, raw, a_log, dt, g, s); });
  }));
  r.add(small_case("kda_l2norm", b, proj * 2, {proj * 4, 3 * proj}, [b](CaseMemory& m) {
    bf16* x = m.bf16(z(b * kKdaProj));
    return SetLaunch([=](cudaStream_t s) { ops::kda_l2norm_cuda({b * kHeads, kHeadDim, 0.088f, 1e-6f}, x, x, s); });
  }));
  r.add(small_case("kda_beta", b, d(b * kHeads) * 6, {d(b * kHeads) * 6, 4 * d(b * kHeads)}, [b](CaseMemory& m) {
    const bf16* x = m.bf16(z(b * kHeads));
    float* beta = m.zeros_of<float>(z(b * kHeads));
    return SetLaunch([=](cudaStream_t s) { ops::kda_beta_cuda(b * kHeads, x, beta, s); });
  }));
  // The MLA output gate: x *= sigmoid(g) over [B, 96 x 128].
  r.add(small_case("sigmoid_gate", b, proj * 4, {proj * 6, 4 * proj}, [b](CaseMemory& m) {
    const bf16* g = m.bf16(z(b * kKdaProj));
    bf16* x = m.bf16(z(b * kKdaProj));
    return SetLaunch([=](cudaStream_t s) { ops::sigmoid_gate_cuda(b * kKdaProj, g, x, s); });
  }));
  r.add(small_case("gated_rmsnorm", b, proj * 6, {proj * 6, 8 * proj}, [b](CaseMemory& m) {
    const bf16* x = m.bf16(z(b * kKdaProj));
    const bf16* gate = m.bf16(z(b * kKdaProj));
    const float* w = m.f32(z(kHeadDim), 0.9f, 1.1f);
    bf16* y = m.zeros_of<bf16>(z(b * kKdaProj));
    return SetLaunch(
        [=](cudaStream_t s) { ops::gated_rmsnorm_cuda({b, kHeads, kHeadDim, 1e-5f}, x, gate, w, y, s); });
  }));
}

// Embedding rows of the 163840 x 7168 bf16 table (one table; the ids differ per set), and the GPU sampling step over
// fp32 logits [B, 163840]: K3's recommended temperature 1, top_p 0.95 (with and without 20 logprobs), and greedy.
void register_embedding_and_sampling(KernelRegistry& r, int64_t b) {
  KernelCase e;
  e.name = "embedding";
  e.shape = fmt::format("B={}", b);
  e.set_bytes = d(b * kHidden) * 4;
  e.prepare = [b](const CudaEnv&, CaseMemory& mem, int n_sets) {
    const bf16* table = mem.bf16(z(kVocab * kHidden));
    std::vector<const int32_t*> ids;
    std::vector<bf16*> out;
    for (int s = 0; s < n_sets; ++s) {
      std::vector<int32_t> host(z(b));
      for (int64_t i = 0; i < b; ++i) host[z(i)] = static_cast<int32_t>((i * 7919 + s * 104729) % kVocab);
      ids.push_back(mem.upload(host));
      out.push_back(mem.zeros_of<bf16>(z(b * kHidden)));
    }
    PreparedKernel k;
    k.cost = {d(b * kHidden) * 4, 0.0};
    k.launch = [=](int s, cudaStream_t stream) {
      ops::embedding_cuda({b, kVocab, kHidden}, table, ids[z(s)], out[z(s)], nullptr, stream);
    };
    return k;
  };
  r.add(e);
  // The engine's step kernel (sample_rows_cuda, what CudaBackend::sample_rows launches): one RowSampling per row.
  // Bytes: one read of the logits (the minimum; the statistics, histogram and gather passes re-read the rows from L2).
  // FLOPs: nominal operations per logit (greedy 1; top_p 4: the exp of the mass histogram and the cuts; logprobs 2
  // more).
  const double logits = d(b * kVocab) * 4;
  auto step_case = [b, logits](const char* name, ops::SamplingParams params, int32_t n_top, double ops_per_logit) {
    return small_case(name, b, logits, {logits, ops_per_logit * d(b * kVocab)}, [=](CaseMemory& m) {
      const float* x = m.f32(z(b * kVocab), -6.0f, 6.0f);
      std::vector<ops::RowSampling> rows(z(b));
      for (int64_t i = 0; i < b; ++i) {
        rows[z(i)] = {params, static_cast<double>(i + 1) / static_cast<double>(b + 2), static_cast<int32_t>(i), n_top};
      }
      const ops::RowSampling* d_rows = m.upload(rows);
      auto* out = static_cast<ops::RowSample*>(m.zeros(z(b) * sizeof(ops::RowSample)));
      const size_t scratch_bytes = ops::sample_rows_workspace_bytes({b, kVocab});
      void* scratch = m.zeros(scratch_bytes);
      return SetLaunch(
          [=](cudaStream_t s) { ops::sample_rows_cuda({b, kVocab}, d_rows, x, out, scratch, scratch_bytes, s); });
    });
  };
  r.add(step_case("sampling_top_p_decode", {1.0f, 0, 0.95f}, -1, 4));
  r.add(step_case("sampling_top_p_logprobs_decode", {1.0f, 0, 0.95f}, 20, 6));
  r.add(step_case("sampling_top_k_top_p_decode", {0.7f, 50, 0.9f}, -1, 4));
  r.add(step_case("sampling_greedy_decode", {0.0f, 0, 1.0f}, -1, 1));
}

}  // namespace

void register_dense_cases(KernelRegistry& r, bool quick) {
  register_linears(r, quick);
  for (int64_t b : decode_batches(quick)) {
    register_norms_and_mixes(r, b);
    register_kda_small(r, b);
    register_embedding_and_sampling(r, b);
  }
}

}  // namespace bg::bench::cuda
