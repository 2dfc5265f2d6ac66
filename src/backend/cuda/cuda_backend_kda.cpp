// CudaBackend (cuda_backend_impl.h): the KDA ops — the short conv, the per-token preparation (fused at decode, per
// sequence at prefill) and the gated delta rule over each sequence's recurrent state.
#include "backend/cuda/cuda_backend_impl.h"

namespace bg::cuda_backend_detail {

void CudaBackend::short_conv(const Tensor& x, const Tensor& weight, const StateRef& state, Tensor& out) {
  BG_PROFILE_OP("short_conv", stream_);
  const int64_t c = x.cols();
  if (step_.all_single_token()) {
    const ops::ConvStateSlots slots = conv_slots(state);
    ops::short_conv_decode_cuda({step_.n_seqs(), c, weight.cols()}, x.as<bf16>(), weight.as<float>(), slots,
                                out.as<bf16>(), stream_);
    return;
  }
  for (int64_t s = 0; s < step_.n_seqs(); ++s) {
    const int64_t b = step_.seq_begin[static_cast<size_t>(s)], e = step_.seq_begin[static_cast<size_t>(s) + 1];
    ops::short_conv_cuda({e - b, c, weight.cols()}, x.as<bf16>() + b * c, weight.as<float>(), conv_state(state, s),
                         out.as<bf16>() + b * c, stream_);
  }
}

void CudaBackend::kda_prep(const KdaPrepArgs& a_in, Tensor& q, Tensor& k, Tensor& v, Tensor& g, Tensor& beta) {
  const bool fused_decode = step_.all_single_token() && kda_prep_fused_ && a_in.head_dim <= ops::kKdaPrepMaxHeadDim &&
                            a_in.conv[0].cols() <= ops::kKdaPrepMaxConv;
  KdaPrepArgs a = a_in;
  if (!fused_decode) {
    for (Tensor& t : a.raw) t = packed(t);
    a.g_raw = packed(a.g_raw);
    a.b = packed(a.b);
  }
  if (!step_.all_single_token() && kda_prep_prefill_fused_) {
    kda_prep_prefill(a, q, k, v, g, beta);
    return;
  }
  if (!fused_decode) {
    Backend::kda_prep(a, q, k, v, g, beta);
    return;
  }
  BG_PROFILE_OP("kda_prep", stream_);
  const int64_t n = q.rows(), width = a.n_heads * a.head_dim;
  BG_CHECK(n == step_.n_seqs(), "kda_prep: {} rows in a decode step of {} sequences", n, step_.n_seqs());
  ops::KdaPrepDecodeInputs in;
  for (size_t i = 0; i < 3; ++i) {
    BG_CHECK(a.raw[i].rows() == n && a.raw[i].cols() == width, "kda_prep: input {} is {}x{}, expected {}x{}", i,
             a.raw[i].rows(), a.raw[i].cols(), n, width);
    in.x[i] = a.raw[i].strided_as<bf16>();
    in.x_row[i] = a.raw[i].ld();
    in.conv_weight[i] = a.conv[i].as<float>();
    in.conv_state[i] = conv_slots(a.conv_state[i]);
  }
  in.g_raw = a.g_raw.strided_as<bf16>();
  in.g_row = a.g_raw.ld();
  in.a_log = a.a_log.as<float>();
  in.dt_bias = a.dt_bias.as<float>();
  in.b = a.b.strided_as<bf16>();
  in.b_row = a.b.ld();
  const ops::KdaPrepDecodeParams p{n, a.n_heads, a.head_dim, a.conv[0].cols(), a.q_scale, 1e-6f, a.gate_lower_bound};
  ops::kda_prep_decode_cuda(p, in, {q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), g.as<float>(), beta.as<float>()},
                            stream_);
}

void CudaBackend::kda(const ops::KdaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
         const Tensor& beta, const StateRef& state, Tensor& out) {
  BG_PROFILE_OP("kda", stream_);
  float* base = state.storage.as<float>() + state.offset;
  const ops::KdaCudaInputs in{q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), g.as<float>(), beta.as<float>()};
  if (step_.all_single_token()) {
    // Every decode step passes the live count (a graph captured without padding replays steps with some).
    ops::kda_recurrent_cuda(p, in, {base, dev_.state_slots, state.slot_stride, dev_.live_tokens}, out.as<bf16>(),
                            stream_);
    return;
  }
  const int64_t qk = p.n_heads * p.head_dim_k, vd = p.n_heads * p.head_dim_v;
  for (const int32_t s : kda_plan_.short_seqs) {
    const int64_t b = step_.seq_begin[static_cast<size_t>(s)];
    ops::KdaParams ps = p;
    ps.n_tokens = step_.seq_begin[static_cast<size_t>(s) + 1] - b;
    const ops::KdaCudaInputs in_s{in.q + b * qk, in.k + b * qk, in.v + b * vd, in.g + b * qk,
                                  in.beta + b * p.n_heads};
    ops::kda_recurrent_cuda(ps, in_s, {base, dev_.state_slots + s, state.slot_stride}, out.as<bf16>() + b * vd,
                            stream_);
  }
  if (kda_plan_.n_seqs() == 0) return;
  // The workspace only grows; a replaced one is kept while the backend lives (as mla_ws_).
  const size_t ws_bytes = ops::kda_chunked_workspace_bytes(p, kda_plan_.n_chunks());
  if (ws_bytes > kda_ws_bytes_) {
    // Chunked steps are never captured, so nothing but earlier launches on this stream can point into the old
    // buffer: wait for them and free it instead of keeping it while the backend lives.
    BG_CHECK(!capturing_, "cuda backend: chunked KDA during graph capture");
    BG_CUDA_CHECK(cudaStreamSynchronize(stream_));
    kda_ws_.reset();
    kda_ws_bytes_ = ws_bytes;
    kda_ws_ = alloc_->allocate(kda_ws_bytes_);
  }
  ops::kda_chunked_varlen_cuda(p, in, {&kda_plan_, dev_.kda_plan, base, state.slot_stride}, out.as<bf16>(),
                               {kda_ws_.get(), kda_ws_bytes_}, stream_);
}

void CudaBackend::kda_prep_prefill(const KdaPrepArgs& a, Tensor& q, Tensor& k, Tensor& v, Tensor& g, Tensor& beta) {
  {
    BG_PROFILE_OP("kda_prep_conv_norm", stream_);
    Tensor* out[3] = {&q, &k, &v};
    const float scales[2] = {a.q_scale, 1.0f};
    for (int64_t s = 0; s < step_.n_seqs(); ++s) {
      const int64_t b = step_.seq_begin[static_cast<size_t>(s)], e = step_.seq_begin[static_cast<size_t>(s) + 1];
      for (size_t i = 0; i < 3; ++i) {
        const int64_t c = a.raw[i].cols();
        const ops::ShortConvParams p{e - b, c, a.conv[i].cols()};
        const bf16* x = a.raw[i].as<bf16>() + b * c;
        bf16* y = out[i]->as<bf16>() + b * c;
        bf16* st = conv_state(a.conv_state[i], s);
        if (i < 2) {
          ops::short_conv_l2norm_cuda(p, {a.head_dim, scales[i], 1e-6f}, x, a.conv[i].as<float>(), st, y, stream_);
        } else {
          ops::short_conv_cuda(p, x, a.conv[i].as<float>(), st, y, stream_);
        }
      }
    }
  }
  kda_gate(a.g_raw, a.a_log, a.dt_bias, a.n_heads, a.gate_lower_bound, g);
  kda_beta(a.b, beta);
}

}  // namespace bg::cuda_backend_detail
