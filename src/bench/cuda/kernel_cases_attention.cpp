// Kernel cases of attention and state at K3 shapes: MLA (96 heads, latent 512 + 64, nope 128, v 128, 64-token cache
// blocks) decode at 4k / 32k context and prefill (the FlashAttention-class path and the absorbed kernel it replaced);
// KDA (96 heads x 128) recurrent decode and chunked prefill (one sequence, and a varlen step of 16 x 512); the KDA
// short conv (12288 channels, kernel 4) at decode and prefill.
#include <fmt/format.h>

#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "bench/cuda/kernel_case.h"
#include "core/error.h"
#include "ops/kda/kda_cuda.h"
#include "ops/kda/kda_varlen_plan.h"
#include "ops/kda_gate/kda_prep_cuda.h"
#include "ops/mla/mla_cuda.h"
#include "ops/mla/mla_decode_cuda.h"
#include "ops/mla/mla_prefill_cuda.h"
#include "ops/short_conv/short_conv_cuda.h"

namespace bg::bench::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int64_t kHeads = 96, kLora = 512, kRope = 64, kNope = 128, kV = 128, kEntry = kLora + kRope;
constexpr int64_t kBlock = 64, kKdaDim = 128, kConvChannels = 96 * 128, kConvWidth = 4;

double d(int64_t v) { return static_cast<double>(v); }
size_t z(int64_t v) { return static_cast<size_t>(v); }

ops::MlaParams mla_params(int64_t n_tokens) {
  ops::MlaParams p;
  p.n_tokens = n_tokens;
  p.n_heads = kHeads;
  p.kv_lora_rank = kLora;
  p.qk_nope_dim = kNope;
  p.qk_rope_dim = kRope;
  p.v_head_dim = kV;
  p.block_size = kBlock;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kNope + kRope));
  return p;
}

// One set of MLA inputs: a paged cache of `n_seqs` sequences x `context` positions (distinct blocks), each query
// token's sequence and position, q, out. W_UK / W_UV are shared by the sets (they are 25 MB, read by every call).
struct MlaSet {
  ops::MlaPagedCache cache;
  const bf16* q = nullptr;
  bf16* out = nullptr;
};

MlaSet make_mla_set(CaseMemory& mem, int64_t n_seqs, int64_t context, const std::vector<int64_t>& positions,
                    const std::vector<int32_t>& seq_of_token) {
  const int64_t blocks_per_seq = (context + kBlock - 1) / kBlock;
  MlaSet s;
  s.cache.base = mem.bf16(z(n_seqs * blocks_per_seq * kBlock * kEntry));
  s.cache.block_stride = kBlock * kEntry;
  std::vector<int32_t> tables(z(n_seqs * blocks_per_seq));
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
  s.cache.block_tables = mem.upload(tables);
  s.cache.max_blocks_per_seq = blocks_per_seq;
  s.cache.seq_idx = mem.upload(seq_of_token);
  s.cache.positions = mem.upload(positions);
  const auto n_tokens = static_cast<int64_t>(positions.size());
  s.q = mem.bf16(z(n_tokens * kHeads * (kNope + kRope)));
  s.out = mem.zeros_of<bf16>(z(n_tokens * kHeads * kV));
  return s;
}

// Absorbed MLA decode: `batch` sequences of one token at position context - 1 (attending `context` keys). tensor_cores:
// the split-KV tensor-core kernel the backend runs for decode steps (mla_decode_cuda, docs/MLA_DECODE.md); else the
// general kernel (mla_attention_cuda) it uses for prefill and mixed steps. even: the even split-KV cut only, without
// the token-aligned schedule (MlaDecodeOptions::align_tokens off), named mla_decode_even.
KernelCase mla_decode_case(int64_t batch, int64_t context, bool tensor_cores = true,
                           ops::MlaDecodeMma mma = ops::MlaDecodeOptions{}.mma, bool even = false) {
  KernelCase c;
  // mla_decode: the default policy; mla_decode_wgmma / _mmasync: the other one, measured beside it.
  if (!tensor_cores) {
    c.name = "mla_decode_general";
  } else if (even) {
    c.name = "mla_decode_even";
  } else if (mma == ops::MlaDecodeOptions{}.mma) {
    c.name = "mla_decode";
  } else {
    c.name = mma == ops::MlaDecodeMma::kWgmma        ? "mla_decode_wgmma"
             : mma == ops::MlaDecodeMma::kWgmmaHeadsM ? "mla_decode_heads_m"
                                                       : "mla_decode_mmasync";
  }
  c.shape = fmt::format("B={} ctx={}", batch, context);
  const double kv = d(batch * context * kEntry) * 2;
  c.set_bytes = kv;
  c.prepare = [=](const CudaEnv& env, CaseMemory& mem, int n_sets) {
    const bf16* w_uk = mem.bf16(z(kHeads * kNope * kLora), 0.05f);
    const bf16* w_uv = mem.bf16(z(kHeads * kV * kLora), 0.05f);
    std::vector<int64_t> positions(z(batch), context - 1);
    std::vector<int32_t> seqs(z(batch));
    for (int64_t i = 0; i < batch; ++i) seqs[z(i)] = static_cast<int32_t>(i);
    std::vector<MlaSet> sets;
    for (int s = 0; s < n_sets; ++s) sets.push_back(make_mla_set(mem, batch, context, positions, seqs));
    const ops::MlaParams p = mla_params(batch);
    PreparedKernel k;
    const double weights = d(kHeads * (kNope + kV) * kLora) * 2;
    const double io = d(batch * kHeads * (kNope + kRope + kV)) * 2;
    // Per token and head: q.k over 576 and p.v over 512 per key, plus absorbing q_nope (128 x 512) and the output
    // (128 x 512).
    const double flops = d(batch * kHeads) * (2.0 * d(context) * d(kEntry + kLora) + 2.0 * d((kNope + kV) * kLora));
    k.cost = {kv + weights + io, flops};
    if (!tensor_cores) {
      k.launch = [=](int s, cudaStream_t stream) {
        const MlaSet& m = sets[z(s)];
        ops::mla_attention_cuda(p, m.q, w_uk, w_uv, m.cache, m.out, stream);
      };
      return k;
    }
    ops::MlaDecodeOptions options;
    options.mma = mma;
    options.align_tokens = !even && ops::mla_decode_align_from_env();  // else as the backend: BG_MLA_DECODE_ALIGN
    const ops::MlaDecodePlan plan = ops::mla_decode_plan(p, env.n_sms, options);
    const ops::MlaDecodeContext ctx{env.cublas, env.cublas_workspace, env.cublas_workspace_bytes,
                                    mem.zeros(plan.ws.total_bytes), plan.ws.total_bytes};
    k.launch = [=](int s, cudaStream_t stream) {
      const MlaSet& m = sets[z(s)];
      ops::mla_decode_cuda(plan, {m.q, w_uk, w_uv, m.out}, m.cache, ctx, stream);
    };
    return k;
  };
  return c;
}

// Prefill of one sequence of `n` tokens at positions 0 .. n - 1 (causal). FLOPs are those of causal attention with
// q/k head dim 192 and v 128 (what a FlashAttention kernel does), so every implementation is held to the same count.
// mla_prefill: the path the backend runs for prefill sequences (mla_prefill_cuda with mla_prefill_mma_from_env():
// cuDNN's fused attention where built in; gather, the two k_nope / v GEMMs and the attention, all timed);
// mla_prefill_wgmma / mla_prefill_mmasync: the same with batchgen's own kernels; mla_prefill_absorbed: the general
// absorbed kernel (CUDA cores, O(T^2) over the 576-wide latent) the non-absorbed path replaced, as a reference point.
KernelCase mla_prefill_case(int64_t n, bool absorbed = false, std::optional<ops::MlaPrefillMma> mma = std::nullopt) {
  KernelCase c;
  if (absorbed) {
    c.name = "mla_prefill_absorbed";
  } else if (!mma) {
    c.name = "mla_prefill";
  } else {
    c.name = *mma == ops::MlaPrefillMma::kWgmma ? "mla_prefill_wgmma"
             : *mma == ops::MlaPrefillMma::kMmaSync ? "mla_prefill_mmasync"
                                                    : "mla_prefill_cudnn";
  }
  c.shape = fmt::format("T={}", n);
  c.set_bytes = absorbed ? d(n * kEntry) * 2 : 0;  // compute-bound: one input set, no L2 rotation needed
  c.prepare = [=](const CudaEnv& env, CaseMemory& mem, int) {
    const bf16* w_uk = mem.bf16(z(kHeads * kNope * kLora), 0.05f);
    const bf16* w_uv = mem.bf16(z(kHeads * kV * kLora), 0.05f);
    std::vector<int64_t> positions(z(n));
    for (int64_t t = 0; t < n; ++t) positions[z(t)] = t;
    const MlaSet m = make_mla_set(mem, 1, n, positions, std::vector<int32_t>(z(n), 0));
    const ops::MlaParams p = mla_params(n);
    PreparedKernel k;
    const double pairs = d(n) * d(n + 1) / 2;
    k.cost = {d(n * kEntry) * 2 + d(n * kHeads * (kNope + kRope + kV)) * 2,
              2.0 * d(kHeads) * d(kNope + kRope + kV) * pairs};
    if (absorbed) {
      k.launch = [=](int, cudaStream_t stream) { ops::mla_attention_cuda(p, m.q, w_uk, w_uv, m.cache, m.out, stream); };
      return k;
    }
    const std::vector<int64_t> seq_begin{0, n};
    const ops::MlaPrefillPlan plan = ops::mla_prefill_plan(positions, seq_begin);
    const ops::MlaPrefillWorkspace ws = ops::mla_prefill_workspace(p, plan);
    void* workspace = mem.zeros(ws.total_bytes);
    const std::vector<std::byte> meta = ops::mla_prefill_meta(plan, ws);
    BG_CUDA_CHECK(cudaMemcpy(workspace, meta.data(), meta.size(), cudaMemcpyHostToDevice));
    auto cudnn = std::make_shared<ops::MlaCudnnPrefill>();
    const ops::MlaPrefillContext ctx{
        {env.cublas, env.cublas_workspace, env.cublas_workspace_bytes, workspace, ws.total_bytes}, cudnn.get()};
    const ops::MlaPrefillMma kind = mma.value_or(ops::mla_prefill_mma_from_env());
    // One eager launch: cuDNN builds its plan and workspace here, outside the timed graph's capture.
    ops::mla_prefill_cuda(p, plan, ws, m.q, w_uk, w_uv, m.cache, m.out, ctx, nullptr, kind);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    if (kind == ops::MlaPrefillMma::kCudnn && !plan.cudnn_calls.empty() && cudnn->launches() == 0) {
      throw Error(fmt::format("mla_prefill: cuDNN declined T={}: {}", n, cudnn->last_refusal()));
    }
    k.launch = [=](int, cudaStream_t stream) {
      ops::mla_prefill_cuda(p, plan, ws, m.q, w_uk, w_uv, m.cache, m.out, ctx, stream, kind);
      (void)cudnn;  // kept alive with the launch
    };
    return k;
  };
  return c;
}

// The attention of mla_prefill alone: cuDNN's fused attention over one fresh T-token sequence whose Q, K ([T, 96, 192])
// and V ([T, 96, 128]) are already in place, as the step launches it (an exact plan unless BG_MLA_CUDNN_EXACT=0).
// Beside mla_prefill it says what the gather, the two expansion GEMMs and the k_pe copy cost; beside torch's SDPA on
// the same shapes (../shared/docs/H200.md) what the graph's masks cost.
KernelCase mla_prefill_attention_case(int64_t n) {
  KernelCase c;
  c.name = "mla_prefill_attention";
  c.shape = fmt::format("T={}", n);
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int) {
    constexpr int64_t kQk = kNope + kRope;
    const bf16* q = mem.bf16(z(n * kHeads * kQk));
    const bf16* k = mem.bf16(z(n * kHeads * kQk));
    const bf16* v = mem.bf16(z(n * kHeads * kV));
    auto* out = mem.zeros_of<bf16>(z(n * kHeads * kV));
    const auto t = static_cast<int32_t>(n), h = static_cast<int32_t>(kHeads);
    const int32_t* lens = mem.upload(std::vector<int32_t>{t, t});
    const int32_t* off_qk = mem.upload(std::vector<int32_t>{0, t * h * static_cast<int32_t>(kQk)});
    const int32_t* off_v = mem.upload(std::vector<int32_t>{0, t * h * static_cast<int32_t>(kV)});
    auto cudnn = std::make_shared<ops::MlaCudnnPrefill>();
    const ops::MlaCudnnLaunch l{1,      kHeads, n,      n,     1.0f / std::sqrt(static_cast<float>(kQk)),
                                true,   q,      k,      v,     out,
                                lens,   lens + 1, off_qk, off_qk, off_v,
                                off_v,  true,   0};
    // The plan is built here, outside the timed graph's capture.
    if (!cudnn->run(l, nullptr)) throw Error(fmt::format("mla_prefill_attention: cuDNN declined T={}: {}", n,
                                                         cudnn->last_refusal()));
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    PreparedKernel pk;
    const double pairs = d(n) * d(n + 1) / 2;
    pk.cost = {d(n * kHeads * (2 * kQk + 2 * kV)) * 2, 2.0 * d(kHeads) * d(kQk + kV) * pairs};
    pk.launch = [=](int, cudaStream_t stream) {
      BG_CHECK(cudnn->run(l, stream), "mla_prefill_attention: cuDNN declined a built plan");
    };
    return pk;
  };
  return c;
}

// The latent cache write of a decode step: one [576] entry per sequence into its block; `normed`: with c_kv's RMSNorm
// in the same launch (mla_cache_write_normed_cuda, Kimi-K3's path).
KernelCase mla_cache_write_case(int64_t batch, bool normed) {
  KernelCase c;
  c.name = normed ? "mla_cache_write_normed_decode" : "mla_cache_write_decode";
  c.shape = fmt::format("B={}", batch);
  c.set_bytes = d(batch * kBlock * kEntry) * 2;
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int n_sets) {
    std::vector<int64_t> positions(z(batch), kBlock / 2);
    std::vector<int32_t> seqs(z(batch));
    for (int64_t i = 0; i < batch; ++i) seqs[z(i)] = static_cast<int32_t>(i);
    std::vector<MlaSet> sets;
    std::vector<const bf16*> latents;
    for (int s = 0; s < n_sets; ++s) {
      sets.push_back(make_mla_set(mem, batch, kBlock, positions, seqs));
      latents.push_back(mem.bf16(z(batch * kEntry)));
    }
    const ops::MlaParams p = mla_params(batch);
    const float* norm = mem.f32(z(kLora), 0.5f, 1.5f);
    PreparedKernel k;
    k.cost = {d(batch * kEntry) * 4, 0.0};
    k.launch = [=](int s, cudaStream_t stream) {
      if (normed) {
        ops::mla_cache_write_normed_cuda(p, latents[z(s)], norm, 1e-6f, sets[z(s)].cache, stream);
      } else {
        ops::mla_cache_write_cuda(p, latents[z(s)], sets[z(s)].cache, stream);
      }
    };
    return k;
  };
  return c;
}

// KDA inputs of n tokens: q, k of norm ~0.6 (as after the L2 norm and scaling; keeps the delta rule stable over
// thousands of replays), v, log decays in [-0.1, 0), beta in (0, 1).
ops::KdaCudaInputs kda_inputs(CaseMemory& mem, int64_t n) {
  const size_t qk = z(n * kHeads * kKdaDim);
  return {mem.bf16(qk, 0.05f), mem.bf16(qk, 0.05f), mem.bf16(qk), mem.f32(qk, -0.1f, -0.001f),
          mem.f32(z(n * kHeads), 0.05f, 0.95f)};
}

double kda_state_bytes() { return d(kHeads * kKdaDim * kKdaDim) * 4; }

KernelCase kda_recurrent_case(int64_t batch) {
  KernelCase c;
  c.name = "kda_recurrent_decode";
  c.shape = fmt::format("B={}", batch);
  c.set_bytes = d(batch) * kda_state_bytes();
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int n_sets) {
    // One pool of n_sets * batch slots; set s uses slots [s * batch, (s + 1) * batch).
    const int64_t slot_floats = kHeads * kKdaDim * kKdaDim;
    float* pool = mem.f32(z(n_sets * batch * slot_floats), -0.01f, 0.01f);
    std::vector<const int32_t*> slots;
    std::vector<ops::KdaCudaInputs> inputs;
    std::vector<bf16*> outs;
    for (int s = 0; s < n_sets; ++s) {
      std::vector<int32_t> idx(z(batch));
      for (int64_t i = 0; i < batch; ++i) idx[z(i)] = static_cast<int32_t>(s * batch + i);
      slots.push_back(mem.upload(idx));
      inputs.push_back(kda_inputs(mem, batch));
      outs.push_back(mem.zeros_of<bf16>(z(batch * kHeads * kKdaDim)));
    }
    // A decode step always passes its live row count (here every row is live), as the backend does.
    const int32_t* live = mem.upload(std::vector<int32_t>{static_cast<int32_t>(batch)});
    const ops::KdaParams p{batch, kHeads, kKdaDim, kKdaDim};
    PreparedKernel k;
    // State read and written; per head: decay, S^T k, rank-1 update, S^T q over K x V.
    k.cost = {2.0 * d(batch) * kda_state_bytes() + d(batch * kHeads * kKdaDim) * (2 * 4 + 4),
              8.0 * d(batch * kHeads * kKdaDim * kKdaDim)};
    k.launch = [=](int s, cudaStream_t stream) {
      ops::kda_recurrent_cuda(p, inputs[z(s)], {pool, slots[z(s)], slot_floats, live}, outs[z(s)], stream);
    };
    return k;
  };
  return c;
}

// Chunked (64): per token and head ~4 K x V state products and 64-token intra-chunk products over K and V.
double kda_chunked_flops(int64_t n_tokens) {
  const double per_token_head = 4.0 * 2.0 * d(kKdaDim * kKdaDim) + 2.0 * 2.0 * 64.0 * d(2 * kKdaDim);
  return d(n_tokens * kHeads) * per_token_head;
}

KernelCase kda_chunked_case(int64_t n) {
  KernelCase c;
  c.name = "kda_chunked_prefill";
  c.shape = fmt::format("T={} H=96", n);
  c.set_bytes = d(n * kHeads * kKdaDim) * 12;
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int) {
    float* state = mem.f32(z(kHeads * kKdaDim * kKdaDim), -0.01f, 0.01f);
    const ops::KdaCudaInputs in = kda_inputs(mem, n);
    bf16* out = mem.zeros_of<bf16>(z(n * kHeads * kKdaDim));
    const ops::KdaParams p{n, kHeads, kKdaDim, kKdaDim};
    const size_t ws_bytes = ops::kda_chunked_workspace_bytes(p, ops::kda_chunk_count(n));
    const ops::KdaWorkspace ws{mem.zeros(ws_bytes), ws_bytes};
    PreparedKernel k;
    k.cost = {d(n * kHeads * kKdaDim) * 14 + 2 * kda_state_bytes(), kda_chunked_flops(n)};
    k.launch = [=](int, cudaStream_t stream) { ops::kda_chunked_cuda(p, in, state, out, ws, stream); };
    return k;
  };
  return c;
}

// A prefill step of n_seqs sequences of len tokens each, on their own state slots, in one varlen launch pair.
KernelCase kda_chunked_varlen_case(int64_t n_seqs, int64_t len) {
  KernelCase c;
  c.name = "kda_chunked_prefill_varlen";
  c.shape = fmt::format("{}x{} H=96", n_seqs, len);
  const int64_t n = n_seqs * len;
  c.set_bytes = d(n * kHeads * kKdaDim) * 12 + d(n_seqs) * kda_state_bytes();
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int) {
    const int64_t slot_floats = kHeads * kKdaDim * kKdaDim;
    float* pool = mem.f32(z(n_seqs * slot_floats), -0.01f, 0.01f);
    const ops::KdaCudaInputs in = kda_inputs(mem, n);
    bf16* out = mem.zeros_of<bf16>(z(n * kHeads * kKdaDim));
    std::vector<int64_t> begin{0};
    std::vector<int32_t> slots;
    for (int64_t s = 0; s < n_seqs; ++s) {
      begin.push_back(begin.back() + len);
      slots.push_back(static_cast<int32_t>(s));
    }
    auto plan = std::make_shared<const ops::KdaVarlenPlan>(ops::kda_varlen_plan(begin, slots));
    const int32_t* plan_dev = mem.upload(plan->packed());
    const ops::KdaParams p{n, kHeads, kKdaDim, kKdaDim};
    const size_t ws_bytes = ops::kda_chunked_workspace_bytes(p, plan->n_chunks());
    const ops::KdaWorkspace ws{mem.zeros(ws_bytes), ws_bytes};
    PreparedKernel k;
    k.cost = {d(n * kHeads * kKdaDim) * 14 + 2 * d(n_seqs) * kda_state_bytes(), kda_chunked_flops(n)};
    k.launch = [=](int, cudaStream_t stream) {
      ops::kda_chunked_varlen_cuda(p, in, {plan.get(), plan_dev, pool, slot_floats}, out, ws, stream);
    };
    return k;
  };
  return c;
}

KernelCase short_conv_decode_case(int64_t batch) {
  KernelCase c;
  c.name = "short_conv_decode";
  c.shape = fmt::format("B={} C=12288", batch);
  const double state = d(kConvChannels * (kConvWidth - 1)) * 2;  // bf16
  c.set_bytes = d(batch) * (state + d(kConvChannels) * 4);
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int n_sets) {
    const float* weight = mem.f32(z(kConvChannels * kConvWidth), -0.5f, 0.5f);
    const int64_t stride = kConvChannels * (kConvWidth - 1);
    bf16* states = mem.bf16(z(n_sets * batch * stride));
    const int32_t* live = mem.upload(std::vector<int32_t>{static_cast<int32_t>(batch)});  // as a decode step passes
    std::vector<ops::ConvStateSlots> slots;
    std::vector<const bf16*> xs;
    std::vector<bf16*> outs;
    for (int s = 0; s < n_sets; ++s) {
      std::vector<int32_t> idx(z(batch));
      for (int64_t i = 0; i < batch; ++i) idx[z(i)] = static_cast<int32_t>(s * batch + i);
      slots.push_back({states, mem.upload(idx), stride, live});
      xs.push_back(mem.bf16(z(batch * kConvChannels)));
      outs.push_back(mem.zeros_of<bf16>(z(batch * kConvChannels)));
    }
    PreparedKernel k;
    k.cost = {d(batch) * (2 * state + d(kConvChannels) * 4) + d(kConvChannels * kConvWidth) * 4,
              2.0 * d(batch * kConvChannels * kConvWidth)};
    k.launch = [=](int s, cudaStream_t stream) {
      ops::short_conv_decode_cuda({batch, kConvChannels, kConvWidth}, xs[z(s)], weight, slots[z(s)], outs[z(s)],
                                  stream);
    };
    return k;
  };
  return c;
}

// The fused KDA decode preparation (kda_prep_decode_cuda) at K3's shape: the q / k / v convs over one pool of
// slots (each slot holds the three bf16 conv states, as the KDA state pool lays them out), the L2 norms, the gate and
// beta. Bytes: the conv states read and written, the inputs (q, k, v, g_raw, b) and outputs (q, k, v, g, beta), the
// conv weights once.
KernelCase kda_prep_decode_case(int64_t batch) {
  KernelCase c;
  c.name = "kda_prep_decode";
  c.shape = fmt::format("B={} H=96 K=128", batch);
  const int64_t part = kConvChannels * (kConvWidth - 1), slot_stride = 3 * part;
  const double io = d(kConvChannels) * (3 * 2 + 2 + 3 * 2 + 4) + d(kHeads) * (2 + 4);
  c.set_bytes = d(batch) * (d(slot_stride) * 2 + io);
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int n_sets) {
    const float* weights[3];
    for (const float*& w : weights) w = mem.f32(z(kConvChannels * kConvWidth), -0.5f, 0.5f);
    bf16* states = mem.bf16(z(n_sets * batch * slot_stride));
    const int32_t* live = mem.upload(std::vector<int32_t>{static_cast<int32_t>(batch)});
    const float* a_log = mem.f32(z(kHeads), -1.0f, 1.0f);
    const float* dt_bias = mem.f32(z(kConvChannels), -1.0f, 1.0f);
    std::vector<ops::KdaPrepDecodeInputs> ins;
    std::vector<ops::KdaPrepDecodeOutputs> outs;
    for (int s = 0; s < n_sets; ++s) {
      std::vector<int32_t> idx(z(batch));
      for (int64_t i = 0; i < batch; ++i) idx[z(i)] = static_cast<int32_t>(s * batch + i);
      const int32_t* slots = mem.upload(idx);
      ops::KdaPrepDecodeInputs in;
      for (int i = 0; i < 3; ++i) {
        in.x[i] = mem.bf16(z(batch * kConvChannels));
        in.x_row[i] = kConvChannels;
        in.conv_weight[i] = weights[i];
        in.conv_state[i] = {states + i * part, slots, slot_stride, live};
      }
      in.g_raw = mem.bf16(z(batch * kConvChannels));
      in.g_row = kConvChannels;
      in.a_log = a_log;
      in.dt_bias = dt_bias;
      in.b = mem.bf16(z(batch * kHeads));
      in.b_row = kHeads;
      ins.push_back(in);
      outs.push_back({mem.zeros_of<bf16>(z(batch * kConvChannels)), mem.zeros_of<bf16>(z(batch * kConvChannels)),
                      mem.zeros_of<bf16>(z(batch * kConvChannels)), mem.zeros_of<float>(z(batch * kConvChannels)),
                      mem.zeros_of<float>(z(batch * kHeads))});
    }
    PreparedKernel k;
    // The bf16 conv states read and written (2 x 2 bytes an element), the step's inputs and outputs, the weights.
    k.cost = {d(batch) * (d(slot_stride) * 4 + io) + 3 * d(kConvChannels * kConvWidth) * 4,
              6.0 * d(batch * kConvChannels * kConvWidth)};
    k.launch = [=](int s, cudaStream_t stream) {
      ops::kda_prep_decode_cuda({batch, kHeads, kKdaDim, kConvWidth, 0.088f, 1e-6f, -5.0f}, ins[z(s)], outs[z(s)],
                                stream);
    };
    return k;
  };
  return c;
}

// norm: the q conv with its L2 norm fused (short_conv_l2norm_cuda, K3's 128-channel heads); else the conv alone. The
// separate norm (kda_l2norm_cuda) reads and writes the conv's output once more: compare the fused case with
// short_conv_prefill plus that pass.
KernelCase short_conv_prefill_case(int64_t n, bool norm) {
  KernelCase c;
  c.name = norm ? "short_conv_l2norm_prefill" : "short_conv_prefill";
  c.shape = fmt::format("T={} C=12288", n);
  c.set_bytes = d(n * kConvChannels) * 4;
  c.prepare = [=](const CudaEnv&, CaseMemory& mem, int) {
    const float* weight = mem.f32(z(kConvChannels * kConvWidth), -0.5f, 0.5f);
    bf16* state = mem.bf16(z(kConvChannels * (kConvWidth - 1)));
    const bf16* x = mem.bf16(z(n * kConvChannels));
    bf16* out = mem.zeros_of<bf16>(z(n * kConvChannels));
    PreparedKernel k;
    k.cost = {d(n * kConvChannels) * 4, 2.0 * d(n * kConvChannels * kConvWidth)};
    k.launch = [=](int, cudaStream_t stream) {
      if (norm) {
        ops::short_conv_l2norm_cuda({n, kConvChannels, kConvWidth}, {128, 0.088f, 1e-6f}, x, weight, state, out,
                                    stream);
      } else {
        ops::short_conv_cuda({n, kConvChannels, kConvWidth}, x, weight, state, out, stream);
      }
    };
    return k;
  };
  return c;
}

}  // namespace

void register_attention_cases(KernelRegistry& r, bool quick) {
  const std::vector<int64_t> decode = quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 16, 64};
  const std::vector<int64_t> contexts = quick ? std::vector<int64_t>{4096} : std::vector<int64_t>{4096, 32768};
  for (int64_t ctx : contexts) {
    for (int64_t b : decode) r.add(mla_decode_case(b, ctx));
    if (ctx == 4096) r.add(mla_decode_case(quick ? 1 : 16, ctx, /*tensor_cores=*/false));
    // The even cut beside the default where the aligned schedule applies (about one token per partition or a few).
    if (ctx == 4096 && !quick) {
      r.add(mla_decode_case(64, ctx, true, ops::MlaDecodeOptions{}.mma, true));
      r.add(mla_decode_case(128, ctx));
      r.add(mla_decode_case(128, ctx, true, ops::MlaDecodeOptions{}.mma, true));
    }
    // The other attention kernels of the decode op, beside the default (mla_decode_plan.h).
    if (!quick) {
      for (const ops::MlaDecodeMma other :
           {ops::MlaDecodeMma::kWgmma, ops::MlaDecodeMma::kWgmmaHeadsM, ops::MlaDecodeMma::kMmaSync}) {
        if (other == ops::MlaDecodeOptions{}.mma) continue;
        for (int64_t b : decode) r.add(mla_decode_case(b, ctx, true, other));
      }
    }
  }
  for (int64_t t : quick ? std::vector<int64_t>{4096} : std::vector<int64_t>{4096, 16384, 65536}) {
    r.add(mla_prefill_case(t));
  }
  if (!quick && ops::MlaCudnnPrefill::built()) {
    for (int64_t t : {4096, 16384}) r.add(mla_prefill_attention_case(t));
  }
  if (!quick) {
    // batchgen's own kernels beside the default (wgmma; mma.sync, the FlashAttention-2 formulation) and the absorbed
    // kernel on CUDA cores (~0.12 s at 4k, ~2 s at 16k) they replaced, as reference points.
    for (int64_t t : {4096, 16384, 65536}) r.add(mla_prefill_case(t, false, ops::MlaPrefillMma::kWgmma));
    for (int64_t t : {4096, 16384}) r.add(mla_prefill_case(t, false, ops::MlaPrefillMma::kMmaSync));
    r.add(mla_prefill_case(4096, /*absorbed=*/true));
  }
  for (int64_t b : decode) {
    r.add(mla_cache_write_case(b, false));
    r.add(mla_cache_write_case(b, true));
  }
  for (int64_t b : decode) r.add(kda_recurrent_case(b));
  r.add(kda_chunked_case(quick ? 2048 : 8192));
  r.add(kda_chunked_varlen_case(16, 512));
  r.add(kda_chunked_varlen_case(128, 64));  // the same chunks as T=8192 with no recurrence: the prepare kernel's share
  for (int64_t b : decode) r.add(short_conv_decode_case(b));
  for (int64_t b : decode) r.add(kda_prep_decode_case(b));
  r.add(short_conv_prefill_case(quick ? 2048 : 8192, false));
  if (!quick) r.add(short_conv_prefill_case(8192, true));
}

}  // namespace bg::bench::cuda
